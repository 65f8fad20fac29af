"""How often one update of an agent crosses between this package and TRL (issue 57: values passed, not parked).

The team hands an agent its rollout and rewards (`score`) and advantages (`fill_micro_batches`) as arguments; the
agent builds its scored batch itself and runs its forward and backward pass itself (`forward_backward`). From the
team loop to the loss, control passes between this package's code and TRL's only twice: into TRL's policy loss, and
from TRL's log-probability forward into the model the agent hands it (`logprob_forward`: shared prompts, the CPU
head, the vLLM ratio). Counted: every call of one of the agent's methods (its own or those it inherits from TRL and
transformers' `Trainer`) from the other side, and every call from TRL into this package on any object, during the
agent's part of the update (`_crossings_of_one_update`). Generation (the team generator) and the optimiser step,
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
TRL = os.path.dirname(trl.__file__)
THEIRS = (TRL, os.path.dirname(transformers.__file__))


def _side(code) -> str | None:
    if code.co_filename.startswith(OURS):
        return "ours"
    if code.co_filename.startswith(THEIRS):
        return "theirs"
    return None  # torch, Accelerate, the standard library: neither side


def _crossings_of_one_update(trainer, agent) -> list[str]:
    """During one optimiser update of the team, less generation and the optimiser step, and within `agent`'s part of
    it: every call of one of `agent`'s methods whose nearest caller on either side is on the other side, and every
    call of this package's code whose nearest caller is TRL's (a callback). A callback into another object than the
    agent counts once, with what it calls: the model an agent hands TRL's log-probability forward runs its own
    kernels (on a CPU, a copy of TRL's fused head that asks this package which positions to score), as a transformers
    model's forward would."""
    crossings, paused = [], [0]
    state = {"agent_frames": 0, "callback": None}

    def profile(frame, event, arg):
        if paused[0] or event not in ("call", "return"):
            return
        if state["callback"] is not None:  # inside a callback from TRL: its own work
            if event == "return" and frame is state["callback"]:
                state["callback"] = None
            return
        own = frame.f_locals.get("self") is agent
        if event == "return":
            state["agent_frames"] -= own
            return
        state["agent_frames"] += own
        if not state["agent_frames"]:  # the team's or another agent's work
            return
        caller = frame.f_back
        while caller is not None and _side(caller.f_code) is None:
            caller = caller.f_back
        callee_side, caller_side = _side(frame.f_code), _side(caller.f_code) if caller else None
        if not callee_side or not caller_side or callee_side == caller_side:
            return
        callback = callee_side == "ours" and caller.f_code.co_filename.startswith(TRL)
        if own or callback:
            crossings.append(f"{caller.f_code.co_qualname} -> {frame.f_code.co_qualname}")
        if callback and not own:  # a model or kernel handed to TRL (an agent's own methods stay watched)
            state["callback"] = frame

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
    # Then four, while the agent overrode TRL's log-probability forward: TRL's loss called the override back, which
    # called TRL's own, which called the agent's model wrapper.
    assert crossings == [
        "AgentGRPOTrainer.policy_loss -> GRPOTrainer._compute_loss",
        "GRPOTrainer._get_per_token_logps_and_entropies -> AgentLogProbForward.__call__",
    ]
    assert not {"_handed_in", "_ratio_for"} & set(dir(agent))  # nothing parked on the agent for TRL to read
