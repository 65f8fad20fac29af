"""Joining TRL's scored GRPO batches of several turns into one batch for the loss, and splitting items over processes."""

import torch
import torch.nn.functional as F


# Per-token tensors of a scored GRPO batch, padded on the right along the completion axis.
_COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
)  # the last two: vLLM generation
_PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # padded on the left
_ROW_KEYS = ("advantages", "old_values", "value_targets")  # one value per row


def concat_scored_batches(batches: list[dict], pad_token_id: int) -> dict:
    """Concatenate scored batches row-wise, padding prompts on the left and completions on the right.

    `num_items_in_batch` (the global count of completion tokens that normalises TRL's loss) is summed.
    """
    if len(batches) == 1:
        return batches[0]
    keys = set(batches[0])
    for batch in batches[1:]:
        if set(batch) != keys:
            raise ValueError(f"Cannot join scored batches with different fields: {sorted(keys)} vs {sorted(batch)}.")
    unknown = keys - set(_COMPLETION_KEYS) - set(_PROMPT_KEYS) - set(_ROW_KEYS) - {"num_items_in_batch"}
    if unknown:
        raise ValueError(f"Multi-turn batches do not support the fields {sorted(unknown)} (e.g. images or vLLM).")
    out = {key: torch.cat([b[key] for b in batches]) for key in _ROW_KEYS if key in keys}
    out["num_items_in_batch"] = sum(b["num_items_in_batch"] for b in batches)
    for key in _PROMPT_KEYS:
        width = max(b[key].shape[1] for b in batches)
        value = pad_token_id if key == "prompt_ids" else 0
        out[key] = torch.cat([F.pad(b[key], (width - b[key].shape[1], 0), value=value) for b in batches])
    for key in _COMPLETION_KEYS:
        if key in keys:
            width = max(b[key].shape[1] for b in batches)
            value = pad_token_id if key == "completion_ids" else 0
            out[key] = torch.cat([F.pad(b[key], (0, width - b[key].shape[1]), value=value) for b in batches])
    return out


def even_shard(total: int, process: int, processes: int) -> tuple[list[int], int]:
    """This process's share of `total` items (every `processes`-th index from `process`), and how many are real.

    Every process gets the same number of indices, so that all generate equally often (ZeRO-3 gathers weights
    collectively during generation): a process with fewer items repeats the last index, whose results it drops.
    """
    real = list(range(process, total, processes))
    return real + [total - 1] * (-(-total // processes) - len(real)), len(real)
