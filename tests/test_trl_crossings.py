"""How often one update of an agent crosses between this package and TRL (issue 57: values passed, not parked).

The team hands an agent its rollout and rewards (`score`) and advantages (`fill_micro_batches`) as arguments; the
agent builds its scored batch itself and runs its forward and backward pass itself (`forward_backward`). From the
team loop to the loss, control passes between this package's code and TRL's (or transformers' `Trainer`) only for
TRL's policy loss and, inside it, the log-probability forward, which the agent wraps (`_get_per_token_logps_and_
entropies`: shared prompts, the CPU head, the vLLM ratio). Generation (the team generator) and the optimiser step,
after the loss, are outside the count.
"""

import os
import sys

import transformers
import trl
from datasets import Dataset

import comlrl_trl
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


OURS = os.path.dirname(comlrl_trl.__file__)
THEIRS = (os.path.dirname(trl.__file__), os.path.dirname(transformers.__file__))


def _side(code) -> str | None:
    if code.co_filename.startswith(OURS):
        return "ours"
    if code.co_filename.startswith(THEIRS):
        return "theirs"
    return None  # torch, Accelerate, the standard library: neither side


def _crossings_of_one_update(trainer, agent) -> list[str]:
    """Every call of one of `agent`'s methods whose nearest caller on either side is on the other side, during one
    optimiser update of the team, less generation and the optimiser step."""
    crossings, paused = [], [0]

    def profile(frame, event, arg):
        if event != "call" or paused[0] or frame.f_locals.get("self") is not agent:
            return
        caller = frame.f_back
        while caller is not None and _side(caller.f_code) is None:
            caller = caller.f_back
        callee_side, caller_side = _side(frame.f_code), _side(caller.f_code) if caller else None
        if callee_side and caller_side and callee_side != caller_side:
            crossings.append(f"{caller.f_code.co_qualname} -> {frame.f_code.co_qualname}")

    def outside_the_count(function):
        def call(*args, **kwargs):
            paused[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                paused[0] -= 1

        return call

    orchestrator = trainer.orchestrator
    orchestrator.team_generation = outside_the_count(orchestrator.team_generation)
    agent.optimizer_step = outside_the_count(agent.optimizer_step)
    update = trainer.optimizer_update

    def traced(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return update(*args, **kwargs)
        finally:
            sys.setprofile(None)

    trainer.optimizer_update = traced
    trainer.train()
    return crossings


def test_one_update_of_an_agent_crosses_into_trl_only_for_its_loss(qwen_path, make_config):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [float(len(x)) for x in a],
        train_dataset=Dataset.from_list([{"prompt": "Say:"}] * 4),
        args=make_config(num_generations=2, per_device_train_batch_size=2, max_new_tokens=4, max_steps=1),
    )
    agent = trainer.agent_trainers[1]
    crossings = _crossings_of_one_update(trainer, agent)
    # Before issue 57 there were nine: score -> TRL's _generate_and_score_completions -> (parked) _generate and
    # _calculate_rewards, TRL's advantages computed and dropped; train_micro_batch -> TRL's training_step ->
    # _prepare_inputs, compute_loss -> _compute_loss -> GRPOTrainer._compute_loss -> the log-probability hook -> TRL's.
    assert crossings == [
        "AgentGRPOTrainer.policy_loss -> GRPOTrainer._compute_loss",
        "GRPOTrainer._compute_loss -> AgentGRPOTrainer._get_per_token_logps_and_entropies",
        "AgentGRPOTrainer._get_per_token_logps_and_entropies -> profiling_decorator.<locals>.wrapper",
    ]
    assert not {"_handed_in", "_ratio_for"} & set(dir(agent))  # nothing parked on the agent for TRL to read
