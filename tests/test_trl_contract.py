"""The TRL (1.16), transformers and Accelerate behaviour that `comlrl_trl.adapters` relies on.

When a library upgrade breaks one of these, the adapters need porting; nothing outside them should.
"""

import ast
import inspect
import textwrap

import pytest
import torch
from datasets import Dataset
from transformers import Trainer
from trl import GRPOTrainer, RewardTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from comlrl_trl.adapters.grpo import LOSS_MODEL_INPUTS, Rollout
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _returned_names(function) -> list[list[str]]:
    """The names of every `return a, b, ...` of a function's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    returns = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            returns.append([element.id for element in node.value.elts if isinstance(element, ast.Name)])
    return returns


def test_generate_returns_the_rollout_fields_in_order():
    assert _parameters(GRPOTrainer._generate) == ["self", "prompts"]
    assert _returned_names(GRPOTrainer._generate) == [list(Rollout._fields)]


@pytest.mark.parametrize(
    ("method", "parameters"),
    [
        (GRPOTrainer._generate_and_score_completions, ["self", "inputs"]),
        (GRPOTrainer._calculate_rewards, ["self", "inputs", "prompts", "completions", "completion_ids_list"]),
        (GRPOTrainer._compute_loss, ["self", "model", "inputs"]),
        (GRPOTrainer._prepare_inputs, ["self", "generation_batch"]),
        (GRPOTrainer._tokenize_prompts, ["self", "prompts"]),
        (Trainer._save_rng_state, ["self", "output_dir"]),
        (Trainer._load_rng_state, ["self", "checkpoint"]),
        (Trainer._save_optimizer_and_scheduler, ["self", "output_dir"]),
        (Trainer._load_optimizer_and_scheduler, ["self", "checkpoint"]),
        (Trainer._save_scaler, ["self", "output_dir"]),
        (Trainer._load_scaler, ["self", "checkpoint"]),
        (Trainer._load_from_checkpoint, ["self", "resume_from_checkpoint", "model"]),
        (Trainer._prepare_for_training, ["self", "max_steps", "train_dataloader", "resume_from_checkpoint"]),
        (Trainer._clip_grad_norm, ["self", "model"]),
        (Trainer._get_output_dir, ["self", "trial"]),
        (Trainer._save_checkpoint, ["self", "model", "trial"]),
        (RewardTrainer._prepare_dataset, ["self", "dataset", "processing_class", "args", "dataset_name"]),
        (Trainer.save_model, ["self", "output_dir", "_internal_call"]),  # adapters.helpers.call_save_model
    ],
)
def test_private_hook_signatures(method, parameters):
    assert _parameters(method)[: len(parameters)] == parameters


def test_the_loss_hands_its_model_argument_to_the_logprob_forward():
    """`policy_loss` hands TRL's loss the agent's log-probability forward as its `model` argument (`logprob_forward`,
    `_RatioFromForward`): TRL's loss must hand `model` on as it got it, call the forward once, and pass it exactly the
    micro-batch entries `LOSS_MODEL_INPUTS` names (by which the agent decides whether prompts are shared)."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert source.count("self._get_per_token_logps_and_entropies(") == 1
    assert "self._get_per_token_logps_and_entropies(\n            model,\n" in source
    tree = ast.parse(textwrap.dedent(source))
    uses = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "model"]
    assert len(uses) == 1  # `model` is read once: the forward's first argument
    call = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_get_per_token_logps_and_entropies"
    )
    from_inputs = [
        keyword.arg
        for keyword in call.keywords
        if isinstance(keyword.value, ast.Call) and ast.unparse(keyword.value) == f"inputs.get('{keyword.arg}')"
    ]
    assert tuple(from_inputs) == LOSS_MODEL_INPUTS
    others = {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords if keyword.arg not in from_inputs}
    assert others == {"compute_entropy": "True", "compute_aux_loss": "self.aux_loss_enabled"}


def _trl_scored(agent, rows, rollout, rewards):
    """TRL's own scored batch of `rollout` with `rewards`, its metrics, and its advantages (what `score` replaces)."""
    agent._generate = lambda prompts: tuple(rollout)
    agent._calculate_rewards = lambda *args: rewards.unsqueeze(1)
    try:
        batch = GRPOTrainer._generate_and_score_completions(agent, rows)
    finally:
        del agent._generate, agent._calculate_rewards
    return batch


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"beta": 0.1},
        {"num_iterations": 2},
        {"mask_truncated_completions": True, "pad_to_multiple_of": 8},
        {"scale_rewards": "batch"},
        {"multi_objective_aggregation": "normalize_then_sum"},
        {"vllm": "token_truncate"},
        {"vllm": "sequence_mask", "vllm_importance_sampling_clip_max": 1.5},
    ],
)
def test_score_equals_trls_scored_batch(qwen_path, make_config, settings):
    """`score` builds TRL's scored batch from the values it is given: every tensor and metric bit for bit as TRL's
    `_generate_and_score_completions` with the same rollout and rewards, less TRL's advantages (the team's enter in
    `fill_micro_batches`)."""
    settings = dict(settings)
    vllm = settings.pop("vllm", None)
    if vllm:
        settings["vllm_importance_sampling_mode"] = vllm
    agent = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda c: [1.0] * len(c),
        train_dataset=Dataset.from_list([{"prompt": "Say:"}] * 8),
        args=make_config(num_agents=1, num_generations=4, per_device_train_batch_size=4, max_new_tokens=6, **settings),
    ).agent_trainers[0]
    agent.model.train()
    prompts = ["Say:"] * 4 + ["Tell me a story:"] * 4
    rows = [{"prompt": p} for p in prompts]
    rollout = agent.generate(prompts)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 0.5, -1.0, 3.0])  # one group with zero spread
    if vllm:
        rollout = rollout._replace(
            logprobs=[
                [None if i == j == 0 else -1.0 + 0.1 * (i - j) for j in range(len(c))]
                for i, c in enumerate(rollout.completion_ids)
            ]
        )
        agent.use_vllm = True
        agent.vllm_importance_sampling_correction = True
        agent.args.steps_per_generation = 2  # off-policy: the ratio comes from a scoring forward, as TRL's
        assert not agent.ratio_from_loss_forward
    agent.metrics("train").clear()  # the generation's
    ours = agent.score(rows, rollout, rewards)
    our_metrics = {key: list(values) for key, values in agent.metrics("train").items()}
    agent.metrics("train").clear()
    theirs = _trl_scored(agent, rows, rollout, rewards)
    their_metrics = {key: list(values) for key, values in agent.metrics("train").items()}
    assert theirs.pop("advantages").shape == (8,)
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert torch.equal(torch.nan_to_num(ours[key], nan=7.0), torch.nan_to_num(value, nan=7.0)), key
    assert our_metrics == their_metrics


def test_shuffle_reads_the_row_count_from_the_first_value():
    """`fill_micro_batches` puts the advantages first because of this (a scalar first raises)."""
    rows = {"advantages": torch.arange(4.0), "num_items_in_batch": torch.tensor(7)}
    shuffled = shuffle_sequence_dict(rows)
    assert sorted(shuffled["advantages"].tolist()) == [0.0, 1.0, 2.0, 3.0]
    assert shuffled["num_items_in_batch"].item() == 7
    with pytest.raises(TypeError):
        shuffle_sequence_dict({"num_items_in_batch": torch.tensor(7), "advantages": torch.arange(4.0)})
    halves = split_tensor_dict(shuffled, 2)
    assert [len(half["advantages"]) for half in halves] == [2, 2]


def test_a_real_agent_scores_a_handed_in_rollout(qwen_path, make_config):
    """The whole seam on a tiny model: generate, score with given rewards, fill and read back the micro-batches,
    and TRL's metric store."""
    agent = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda c: [1.0] * len(c),
        train_dataset=Dataset.from_list([{"prompt": "Say:"}] * 2),
        args=make_config(num_agents=1, num_generations=2, per_device_train_batch_size=2, max_new_tokens=4),
    ).agent_trainers[0]
    agent.model.train()
    rollout = agent.generate(["Say:"] * 2)
    assert isinstance(rollout, Rollout) and len(rollout.completion_ids) == 2
    assert all(len(ids) <= 4 for ids in rollout.completion_ids) and all(
        isinstance(c, str) for c in rollout.completions
    )
    batch = agent.score([{"prompt": "Say:"}] * 2, rollout, torch.tensor([0.0, 1.0]))
    assert "advantages" not in batch
    assert {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch"} <= set(batch)
    assert batch["completion_ids"].shape[0] == 2
    assert agent.metrics("train")["reward"] == [0.5]  # TRL logged the handed-in rewards' mean
    agent.fill_micro_batches(batch, torch.tensor([-1.0, 1.0]))
    assert sorted(agent.micro_batch(0)["advantages"].tolist()) == [-1.0, 1.0]
    with pytest.raises(RuntimeError, match="generate"):
        agent._generate(["Say:"])  # outside score(), generation goes through generate()
    with pytest.raises(RuntimeError, match="score"):
        agent._generate_and_score_completions([{"prompt": "Say:"}])  # TRL's scoring is never run on an agent
    assert not {"_handed_in", "_ratio_for"} & set(dir(agent))  # nothing is parked on the agent for TRL to read


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_vllm_correction_from_the_loss_forward_equals_trls(qwen_path, make_config, monkeypatch, mode):
    """On-policy vLLM generation takes the agent's log-probabilities for the importance-sampling ratio from the
    loss's own forward (`ratio_from_loss_forward`) instead of TRL's extra scoring forward. The batch then has no
    old log-probabilities or ratio, and the loss, its gradients and the logged ratios equal TRL's path."""
    agent = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda c: [1.0] * len(c),
        train_dataset=Dataset.from_list([{"prompt": "Say:"}] * 4),
        args=make_config(
            num_agents=1,
            num_generations=4,
            per_device_train_batch_size=4,
            max_new_tokens=6,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_max=1.5,
        ),
    ).agent_trainers[0]
    agent.model.train()
    agent.current_gradient_accumulation_steps = 1
    rows, rewards = [{"prompt": "Say:"}] * 4, torch.tensor([0.0, 1.0, 2.0, 3.0])
    rollout = agent.generate(["Say:"] * 4)
    # The engine's log-probabilities: the agent's own, shifted by a fixed pattern (some ratios get clipped).
    plain = agent.score(rows, rollout, rewards)
    ids = torch.cat([plain["prompt_ids"], plain["completion_ids"]], dim=1)
    mask = torch.cat([plain["prompt_mask"], plain["completion_mask"]], dim=1)
    own = agent.per_token_logps(agent.model, ids, mask, plain["completion_ids"].shape[1], batch_size=4)
    shift = torch.tensor([0.3, -0.2, 0.1, -0.4, 0.05, 0.2])
    logprobs = [(own[i, : len(c)] + shift[: len(c)]).tolist() for i, c in enumerate(rollout.completion_ids)]
    rollout = rollout._replace(logprobs=logprobs)
    agent.use_vllm = True
    agent.vllm_importance_sampling_correction = True  # as use_generation_engines resolves it for top_p=1
    advantages = torch.tensor([-1.0, 0.0, 0.5, 2.0])  # a non-zero sum: equal ratios would not cancel out

    def loss_and_gradients(ratio_from_loss):
        monkeypatch.setattr(type(agent), "ratio_from_loss_forward", property(lambda self: ratio_from_loss))
        agent.metrics("train").clear()
        batch = agent.score(rows, rollout, rewards)
        assert ("old_per_token_logps" in batch) is not ratio_from_loss
        assert ("importance_sampling_ratio" in batch) is not ratio_from_loss
        agent.model.zero_grad()
        loss = agent.policy_loss(agent.model, {"advantages": advantages, **batch})
        loss.backward()
        gradients = [p.grad.clone() for p in agent.model.parameters() if p.grad is not None]
        return loss.item(), gradients, agent.metrics("train")["sampling/importance_sampling_ratio/mean"]

    trl_loss, trl_gradients, trl_ratios = loss_and_gradients(False)
    loss, gradients, ratios = loss_and_gradients(True)
    assert loss != 0.0 and loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    assert len(gradients) == len(trl_gradients) > 0
    assert all(torch.allclose(g, t, rtol=1e-4, atol=1e-7) for g, t in zip(gradients, trl_gradients))
    assert ratios == pytest.approx(trl_ratios, rel=1e-5) and 0.0 < ratios[0] < 1.5


def test_the_correction_comes_from_the_loss_forward_only_on_policy(qwen_path, make_config):
    agent = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda c: [1.0] * len(c),
        train_dataset=Dataset.from_list([{"prompt": "Say:"}] * 4),
        args=make_config(num_agents=1, num_generations=2, per_device_train_batch_size=2),
    ).agent_trainers[0]
    assert not agent.ratio_from_loss_forward  # no vLLM: nothing to correct
    agent.use_vllm = True
    agent.vllm_importance_sampling_correction = True  # as use_generation_engines resolves it for top_p=1
    assert agent.ratio_from_loss_forward
    agent.num_iterations = 2  # a second pass over the samples after an optimiser step: TRL's scoring forward
    agent.args.gradient_accumulation_steps = 1
    assert not agent.ratio_from_loss_forward
    agent.num_iterations = 1
    agent.vllm_importance_sampling_correction = False
    assert not agent.ratio_from_loss_forward
