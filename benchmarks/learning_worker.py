"""One learning run per process: `python learning_worker.py {ours|peer|initial} JSON_SETTINGS` prints one JSON line.

The run is the seed tutorial (two agents, the length-ratio reward scaled by 100, the ten tutorial prompts) written
as a user writes it with either package: the tutorial's settings (`epochs`, `lr`, `k`, `tokens`) and each
package's defaults for everything else, plus `overrides` (ours only: labelled rows that change a default). The team
is evaluated with `learning_task.evaluate_team` after every epoch (the untrained team once, by `initial`: it is the
same for every system and seed); the CPU seconds of `train()` are counted without the evaluations. The peer worker runs in the peer's own virtual environment
(comlrl 1.4.3) and imports nothing from this repository but `learning_task.py`.

Budget mode (`learning.py --budget`): settings with `budget_cpu_s` and `marks` (ascending CPU seconds, the last one
the budget) make ours train for as many epochs as the budget takes (at most `max_epochs`) and evaluate the team at
the update boundary nearest each mark (`EvaluateAtMarks`), the held-out prompts at the last one, where training
stops. `lora` (a dict: `r`, `alpha`, `targets`) trains LoRA adapters (ours only). `keep_rng` restores the torch RNG
after every evaluation (the protocol seeds its own samples), so that evaluating more often does not change what a
run samples in training.
"""

import json
import os
import random
import sys
import time
from functools import partial
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning_task import HELD_OUT_PROMPTS, TRAIN_PROMPTS, as_chat_text, evaluate_team, length_ratio_reward  # noqa: E402
from workers import cpu_seconds  # noqa: E402


class Clock:
    """CPU seconds spent training: the process's CPU time less the time spent evaluating."""

    def __init__(self):
        self.start = cpu_seconds()
        self.evaluating = 0.0

    def training(self) -> float:
        return cpu_seconds() - self.start - self.evaluating


def prompts(s, tokenizer, texts):
    """The task's prompts as both packages see them: plain text, or with `chat` the chat template's text."""
    return as_chat_text(tokenizer, texts) if s.get("chat") else list(texts)


def evaluation_point(s, clock, models, tokenizers, epoch, updates, held_out=None):
    """Evaluate on the training prompts; after the last epoch (or where `held_out` says) on the held-out prompts
    too."""
    import torch

    begin = cpu_seconds()
    rng = torch.get_rng_state() if s.get("keep_rng") else None
    train = evaluate_team(models, tokenizers, prompts(s, tokenizers[0], TRAIN_PROMPTS), s["tokens"], s["eval_samples"])
    point = {"epoch": epoch, "updates": updates, **train}
    if epoch == s["epochs"] if held_out is None else held_out:
        texts = prompts(s, tokenizers[0], HELD_OUT_PROMPTS)
        point["held_out"] = evaluate_team(models, tokenizers, texts, s["tokens"], s["eval_samples"])
    if rng is not None:
        torch.set_rng_state(rng)
    clock.evaluating += cpu_seconds() - begin
    point["train_cpu_s"] = clock.training()
    print(json.dumps({"point": point}), file=sys.stderr, flush=True)
    return point


def load_team(model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    agents = [AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32) for _ in range(2)]
    return tokenizer, agents


def seed_everything(seed):
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def evaluate_at_marks(s, clock_of, points, trainer_of, tokenizer):
    """A callback for budget mode: at the end of an update, evaluate the team once for every mark in `s["marks"]`
    (CPU seconds of training, evaluations excluded) that the update boundary nearest it has passed: a mark is taken at
    this update's end when the training CPU time plus half an update (the mean so far) reaches it, so that the
    evaluated time is the mark's to within half an update either way. At the last mark (the budget) the held-out
    prompts are evaluated too and training stops. Marks that one update passes together share one evaluation.
    `clock_of` and `trainer_of` return the run's `Clock` and trainer (made after the callback)."""
    from transformers import TrainerCallback

    marks = s["marks"]

    def evaluate(state, due, reached):
        last = len(points) + due == len(marks)
        team = trainer_of().agents
        point = evaluation_point(s, clock_of(), team, [tokenizer] * 2, state.epoch, state.global_step, held_out=last)
        for _ in range(due):
            points.append(dict(point, mark_cpu_s=marks[len(points)], budget_reached=reached))
        return last

    class EvaluateAtMarks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            used = clock_of().training()
            nearest = used + used / max(state.global_step, 1) / 2
            due = sum(1 for mark in marks[len(points) :] if nearest >= mark)
            if due and evaluate(state, due, True):
                control.should_training_stop = True
            return control

        def on_train_end(self, args, state, control, **kwargs):
            if len(points) < len(marks):  # `max_epochs` ran out before the budget did
                evaluate(state, len(marks) - len(points), False)

    return EvaluateAtMarks()


def lora_config(s):
    """`s["lora"]` ({"r", "alpha", "targets"}) as a peft `LoraConfig`, or None."""
    if not s.get("lora"):
        return None
    from peft import LoraConfig

    lora = s["lora"]
    return LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules=lora["targets"], task_type="CAUSAL_LM"
    )


def run_ours(s):
    from contextlib import nullcontext

    from transformers import TrainerCallback
    from weight_rounding import FORWARD_WEIGHTS, WeightRounding, seen_change

    from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl_trl.utils.reward_processor import RewardProcessors

    seed_everything(s["seed"])
    tokenizer, agents = load_team(s["model"])
    rounding = None
    if s.get("forward_weights", "as-trained") != "as-trained":
        rounding = WeightRounding(agents, mode=FORWARD_WEIGHTS[s["forward_weights"]].mode, seed=s["seed"])
    budget = s.get("budget_cpu_s") is not None
    if budget and rounding is not None:
        raise ValueError("budget mode does not round forward weights")
    config = MAGRPOConfig(
        output_dir=s["output_dir"],
        num_train_epochs=s.get("max_epochs", 50) if budget else s["epochs"],
        agent_learning_rate=s["lr"],
        logging_steps=10,
        num_generations=s["k"],
        num_turns=1,
        max_new_tokens=s["tokens"],
        seed=s["seed"],
        report_to="none",
        disable_tqdm=True,
        **s["overrides"],
    )
    points = []
    clock = None

    class EvaluateEachEpoch(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            epoch = len(points) + 1
            change = None
            if rounding is not None:  # measured while the clock counts evaluation time
                begin = cpu_seconds()
                change = seen_change(rounding.initial, rounding.master_weights())
                clock.evaluating += cpu_seconds() - begin
            with rounding.paused() if rounding is not None else nullcontext():  # evaluated as the other runs are
                points.append(evaluation_point(s, clock, trainer.agents, [tokenizer] * 2, epoch, state.global_step))
            if change is not None:
                points[-1]["seen_change"] = change

    trainer = MAGRPOTrainer(
        agents=agents,
        reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=_dataset(prompts(s, tokenizer, TRAIN_PROMPTS)),
        tokenizer=tokenizer,
        peft_config=lora_config(s),
        callbacks=[
            evaluate_at_marks(s, lambda: clock, points, lambda: trainer, tokenizer) if budget else EvaluateEachEpoch()
        ],
    )
    clock = Clock()
    trainer.train()
    return points, trainer.state.global_step


def run_peer(s):
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from comlrl.utils.reward_processor import RewardProcessors

    seed_everything(s["seed"])
    tokenizer, agents = load_team(s["model"])
    config = MAGRPOConfig(
        num_train_epochs=1,  # one epoch per train() call, so that the team is evaluated between epochs
        agent_learning_rate=s["lr"],
        logging_steps=10,
        num_generations=s["k"],
        num_turns=1,
        max_new_tokens=s["tokens"],
    )
    trainer = MAGRPOTrainer(
        agents=agents,
        reward_func=partial(length_ratio_reward, target_min=2, target_max=3),
        reward_processor=RewardProcessors.scale(factor=100.0),
        args=config,
        train_dataset=_dataset(prompts(s, tokenizer, TRAIN_PROMPTS)),
        tokenizer=tokenizer,
    )
    steps = []
    optimizer = trainer.optimizers[-1]  # agents update in turn: a team update ends with the last one's
    original_step = optimizer.step

    def counted_step(*args, **kwargs):
        steps.append(1)
        return original_step(*args, **kwargs)

    optimizer.step = counted_step
    clock = Clock()
    points = []
    for epoch in range(1, s["epochs"] + 1):
        trainer.train()
        points.append(evaluation_point(s, clock, trainer.agents, [tokenizer] * 2, epoch, len(steps)))
    return points, len(steps)


def run_initial(s):
    """The untrained team's evaluation: the same for every system and seed, so it is measured once."""
    tokenizer, agents = load_team(s["model"])
    team = [tokenizer] * 2
    held_out = evaluate_team(agents, team, prompts(s, tokenizer, HELD_OUT_PROMPTS), s["tokens"], s["eval_samples"])
    train = evaluate_team(agents, team, prompts(s, tokenizer, TRAIN_PROMPTS), s["tokens"], s["eval_samples"])
    return [{"epoch": 0, "updates": 0, **train, "held_out": held_out, "train_cpu_s": 0.0}], 0


def _dataset(texts):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": texts})


def main():
    system, settings = sys.argv[1], json.loads(sys.argv[2])
    settings.setdefault("overrides", {})
    os.environ.setdefault("WANDB_MODE", "disabled")
    wall = time.perf_counter()
    points, updates = {"ours": run_ours, "peer": run_peer, "initial": run_initial}[system](settings)
    print(json.dumps({"points": points, "updates": updates, "wall_s": time.perf_counter() - wall}), flush=True)


if __name__ == "__main__":
    main()
