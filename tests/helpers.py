"""Helpers shared by the trainer tests."""

import torch


def length_ratio_reward(first, second, *, batch_items):
    """Joint reward with variance inside every group: the second answer's length over the first's."""
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def changed(before, model):
    """Names of the trainable parameters that differ from the snapshot."""
    return {name for name, p in model.named_parameters() if name in before and not torch.equal(before[name], p)}


def sampling_ratios(trainer) -> list[float]:
    """TRL's logged mean importance-sampling ratio of every agent at every logged step (use_vllm runs)."""
    return [
        log[f"agent_{a}/sampling/importance_sampling_ratio/mean"]
        for log in trainer.state.log_history
        for a in range(len(trainer.agents))
        if f"agent_{a}/sampling/importance_sampling_ratio/mean" in log
    ]
