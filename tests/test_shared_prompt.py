"""The log-probability forward with shared prompts packed (`comlrl_trl/adapters/shared_prompt.py`): the layout, worked
out by hand; the values and gradients, against TRL's forward; when it applies."""

import pytest
import torch
from trl import GRPOTrainer

from comlrl_trl.adapters import shared_prompt
from comlrl_trl.adapters.shared_prompt import PackedRows, SharedPromptModel, packing_pays
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


# Three rows of a 4-token prompt and a 2-token completion. Rows 0 and 2 share prompt A (11 12 13 14); row 1 has
# prompt B (21 22), left-padded by two, and a completion that ended after one token.
IDS = torch.tensor(
    [
        [11, 12, 13, 14, 31, 32],
        [0, 0, 21, 22, 41, 0],
        [11, 12, 13, 14, 51, 52],
    ]
)
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
)


def test_packed_layout_by_hand():
    pack = PackedRows(IDS, MASK, prefix=3)
    # Prompt A's first three tokens, B's one unpadded token, then each row's last prompt token and completion.
    assert pack.input_ids.tolist() == [11, 12, 13, 21, 14, 31, 32, 22, 41, 0, 14, 51, 52]
    # Their columns in TRL's rows: B's token 21 sits in column 2, after two padding columns.
    assert pack.positions.tolist() == [0, 1, 2, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5]
    assert len(pack) == 13 and pack.prompt_tokens == 4
    sees = {
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {3},
        4: {0, 1, 2, 4},  # row 0: prompt A, then itself
        5: {0, 1, 2, 4, 5},
        6: {0, 1, 2, 4, 5, 6},
        7: {3, 7},  # row 1: prompt B's token, then itself
        8: {3, 7, 8},
        9: {3, 7, 8},  # after the end of row 1's completion: the padding itself is no key
        10: {0, 1, 2, 10},  # row 2: prompt A, not row 0's tokens
        11: {0, 1, 2, 10, 11},
        12: {0, 1, 2, 10, 11, 12},
    }
    assert {q: set(pack.mask[q].nonzero().flatten().tolist()) for q in range(13)} == sees


def test_packed_labels_and_unpacking_by_hand():
    pack = PackedRows(IDS, MASK, prefix=3)
    labels = IDS.masked_fill(MASK == 0, -100)
    labels[:, :-2] = -100  # TRL's labels: completion tokens only
    x = -100
    assert pack.labels(labels).tolist() == [x, x, x, x, x, 31, 32, x, 41, x, x, 51, 52]
    # The fused head's position i scores token i + 1: row 0's completion tokens 5 and 6 are scored at 4 and 5.
    scored = pack.unpack(torch.arange(12.0)[None])
    assert scored.tolist() == [[4, 5], [7, 8], [10, 11]]
    assert pack.unpack(None) is None


def test_packing_pays_counts_linear_and_attention_work(monkeypatch):
    monkeypatch.setattr(shared_prompt, "MIN_SAVED_WORK", 1e8)
    # 4 rows of 30 tokens against 94 packed tokens, 2 layers of width 64:
    # 1e6 parameters per token: 1.2e8 + 4 * 900 * 256 = 120_921_600 against 9.4e7 + 94**2 * 256 = 96_262_016.
    assert not packing_pays(4, 30, 94, 10**6, 64, 2)
    # 1e7: 1_200_921_600 against 942_262_016, 2.6e8 saved.
    assert packing_pays(4, 30, 94, 10**7, 64, 2)
    # Attention grows with the square of the packed length: 1000 packed tokens of width 4096 cost more than 4 rows.
    assert not packing_pays(4, 300, 1000, 10**7, 4096, 2)


def _rows(model, prompt_lengths=(9, 6), completion=5, rows=4):
    """`rows` rows alternating between prompts of `prompt_lengths` real tokens (left-padded to the longest), with
    completions of random tokens, the third of which ends two tokens early."""
    torch.manual_seed(0)
    width = max(prompt_lengths)
    prompts = [torch.randint(3, model.config.vocab_size, (width,)) for _ in prompt_lengths]
    ids = torch.stack([prompts[r % len(prompts)] for r in range(rows)])
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : width - prompt_lengths[r % len(prompts)]] = 0
    ids = ids * mask
    completion_ids = torch.randint(3, model.config.vocab_size, (rows, completion))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, -2:] = 0
    return torch.cat([ids, completion_ids * completion_mask], 1), torch.cat([mask, completion_mask], 1), completion


def _logps_entropy_grads(method, agent, ids, mask, completion):
    model = agent.model
    model.zero_grad()
    logps, entropy, _ = method(agent, model, ids, mask, completion, compute_entropy=True)
    (logps * torch.arange(1.0, completion + 1)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy.detach(), grads


def _model_calls(agent, monkeypatch) -> list[tuple[int, int]]:
    """The shapes of `input_ids` the agent's model is called with, from now on."""
    shapes = []
    forward = agent.model.forward

    def spy(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(agent.model, "forward", spy)
    return shapes


@pytest.fixture
def make_agent(make_config, prompts_dataset):
    """Agent 0 of a two-agent team of the tiny model at `path`."""

    def make(path, **settings):
        team = MAGRPOTrainer(
            agent_model=path,
            num_agents=2,
            reward_func=lambda a, b: [0.0] * len(a),
            args=make_config(**settings),
            train_dataset=prompts_dataset,
        )
        return team.agent_trainers[0]

    return make


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen2 bf16"])
def test_values_and_gradients_are_trls(kind, make_agent, qwen_path, llama_path, monkeypatch):
    bf16 = kind.endswith("bf16")
    agent = make_agent(llama_path if kind == "llama" else qwen_path, bf16=bf16)
    # Both run under the agent's autocast; in bf16 the other matrix shapes round differently at bf16's 2**-8.
    atol, scale = (2e-2, 1e-2) if bf16 else (2e-6, 1e-6)
    monkeypatch.setattr(shared_prompt, "MIN_SAVED_WORK", -float("inf"))
    ids, mask, completion = _rows(agent.model)
    shapes = []
    call = SharedPromptModel.__call__

    def spy(self, **kwargs):
        out = call(self, **kwargs)
        shapes.append((tuple(kwargs["input_ids"].shape), tuple(out.log_probs.shape)))
        return out

    monkeypatch.setattr(SharedPromptModel, "__call__", spy)
    packed_lengths = _model_calls(agent, monkeypatch)
    ours = _logps_entropy_grads(type(agent).logps_and_entropies, agent, ids, mask, completion)
    assert shapes == [((4, 14), (4, 5))]
    # One call on one packed row: the two prompts' first 8 and 5 real tokens, then 4 rows of 1 + 5 tokens.
    assert packed_lengths == [(1, 8 + 5 + 4 * 6)]
    theirs = _logps_entropy_grads(GRPOTrainer._get_per_token_logps_and_entropies, agent, ids, mask, completion)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=atol)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=atol)
    assert torch.all(ours[0][2, -2:] == 0)  # after the completion's end: log-probability 0, as in TRL
    assert ours[2].keys() == theirs[2].keys() and len(ours[2]) > 0
    for name, grad in theirs[2].items():
        # Float rounding of other matrix shapes: within 1e-6 (bf16: 1e-2) of the largest entry (a row that saw another
        # row's tokens, or a wrong position, moves gradients by a large part of it).
        torch.testing.assert_close(ours[2][name], grad, rtol=0, atol=scale * grad.abs().max().item(), msg=name)


def test_a_tiny_model_is_not_packed_at_the_default_threshold(make_agent, qwen_path, monkeypatch):
    # The tiny model saves a few thousand multiply-adds, far below the Python a packed call costs; even with every
    # prompt token shared it could not save enough, so no pack is built either.
    agent = make_agent(qwen_path)
    ids, mask, completion = _rows(agent.model)
    calls = _model_calls(agent, monkeypatch)
    packs = []
    monkeypatch.setattr(PackedRows, "__init__", lambda self, *args: packs.append(args))
    agent.logps_and_entropies(agent.model, ids, mask, completion)
    assert calls == [(4, 14)] and packs == []


@pytest.mark.parametrize("change", ["image inputs", "deepspeed", "several processes"])
def test_agents_leave_other_setups_to_trls_forward(change, make_agent, qwen_path, monkeypatch):
    agent = make_agent(qwen_path)
    kwargs = {"batch_size": 4, "compute_entropy": True}
    assert type(agent)._shares_prompts(agent, agent.model, kwargs)
    if change == "image inputs":
        kwargs["pixel_values"] = torch.zeros(1, 3, 8, 8)
    elif change == "deepspeed":  # its engine, like DDP's wrapper, expects the forward TRL makes
        monkeypatch.setattr(agent, "is_deepspeed_enabled", True)
    else:
        monkeypatch.setattr(type(agent.accelerator), "num_processes", property(lambda self: 2))
    assert not type(agent)._shares_prompts(agent, agent.model, kwargs)


@pytest.mark.parametrize("change", ["eager attention", "other layers", "one-token prompts"])
def test_models_and_rows_left_to_trls_forward(change, make_agent, qwen_path, monkeypatch):
    monkeypatch.setattr(shared_prompt, "MIN_SAVED_WORK", -float("inf"))
    agent = make_agent(qwen_path)
    ids, mask, completion = _rows(agent.model)
    if change == "eager attention":  # eager attention adds its mask: it takes no boolean one
        monkeypatch.setattr(agent.model.config, "_attn_implementation", "eager")
    elif change == "other layers":
        monkeypatch.setattr(shared_prompt, "_LAYERS", ("MistralDecoderLayer",))
    else:  # nothing to share: the last prompt token runs with its row
        ids, mask = ids[:, -completion - 1 :], mask[:, -completion - 1 :]
    calls = _model_calls(agent, monkeypatch)
    agent.logps_and_entropies(agent.model, ids, mask, completion)
    assert calls == [tuple(ids.shape)]


def test_training_with_packed_prompts_matches_trls_forward(make_config, qwen_path, monkeypatch):
    """Two updates from one generation (the loss forward, and the old log-probabilities of the second update's
    micro-batch) give the same losses and weights, packed or not, for every agent."""
    from datasets import Dataset

    packs = []  # one per packed model call, which takes the pack's labels
    labels = PackedRows.labels

    def counted(self, *args):
        packs.append(1)
        return labels(self, *args)

    monkeypatch.setattr(PackedRows, "labels", counted)

    def train(threshold):
        monkeypatch.setattr(shared_prompt, "MIN_SAVED_WORK", threshold)
        team = MAGRPOTrainer(
            agent_model=qwen_path,
            num_agents=2,
            reward_func=lambda a, b: [float(len(x) - len(y)) for x, y in zip(a, b)],
            args=make_config(steps_per_generation=2, learning_rate=1e-3),
            train_dataset=Dataset.from_dict({"prompt": ["Tell me a story:", "Name a colour, please"]}),
        )
        before = [[p.detach().clone() for p in agent.model.parameters()] for agent in team.agent_trainers]
        team.train()
        after = [[p.detach().clone() for p in agent.model.parameters()] for agent in team.agent_trainers]
        losses = [value for row in team.state.log_history for key, value in row.items() if key.endswith("/loss")]
        return before, after, losses

    before, packed, packed_losses = train(-float("inf"))
    assert len(packs) == 2 * 3  # per agent: two loss forwards and the second micro-batch's old log-probabilities
    _, unpacked, losses = train(float("inf"))
    assert len(packs) == 6
    assert len(losses) >= 2 and packed_losses == pytest.approx(losses, abs=1e-6)  # both agents' losses
    for agent in range(2):
        assert any(not torch.equal(a, b) for a, b in zip(before[agent], packed[agent]))  # every agent trained
        # Two AdamW updates of 1e-3 move a weight by up to 2e-3 whatever the gradient's size; float rounding of other
        # matrix shapes moved one weight in 16384 by 1.1e-6 (a row seeing another row's tokens moves most by ~1e-3).
        for a, b in zip(packed[agent], unpacked[agent]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
