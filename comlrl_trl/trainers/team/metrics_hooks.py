"""The one custom-metrics hook of every team trainer, and the check of the documented names that feed it.

Evaluation reduces per-item rows to scalars: `EvalMetrics.rows` turns the local evaluation items into one dict
each, the rows of every process are gathered, and `EvalMetrics.reduce` returns the metrics (the trainer adds
`eval/`). CoMLRL documents two spellings of that hook and both build an `EvalMetrics`:

- `eval_logger(*, agent_completions_turns, batch_items, prompts)` gives the rows and
  `eval_aggregator(rows, *, num_turns)` reduces them (MAGRPO, MADPO, MARLHF, and the actor-critic trainers);
- `metrics_callback(rollouts)` gives each item's row from its `RolloutSample`s and rows are averaged (IAC, MAAC and
  MARLHF's actor-critic stages, where it also runs on every training rollout).

A trainer names the spellings it honours in `metrics_hooks`; any other is refused at construction.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


MetricsHookName = Literal["eval_logger", "metrics_callback"]


@dataclass(frozen=True)
class EvalMetrics:
    """Custom evaluation metrics: `rows(items, completions, prompts)` -> one dict per local item (completions and
    prompts are `[agent][item][turn]`); `reduce(rows, num_turns)` -> scalars over every process's rows."""

    rows: Callable[[list, list, list], list[dict[str, Any]]]
    reduce: Callable[[list[dict[str, Any]], int], dict[str, float]]


def check_metrics_hooks(
    owner: str,
    accepted: tuple[MetricsHookName, ...],
    eval_logger: Callable | None,
    eval_aggregator: Callable | None,
    metrics_callback: Callable | None,
) -> None:
    """Refuse, before any model is loaded, a hook `owner` cannot honour, a half pair, a non-callable or two hooks."""
    if (eval_logger is None) != (eval_aggregator is None):
        raise ValueError("eval_logger and eval_aggregator work together: pass both or neither.")
    for name, hook in (
        ("eval_logger", eval_logger),
        ("eval_aggregator", eval_aggregator),
        ("metrics_callback", metrics_callback),
    ):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be a callable, got {type(hook).__name__}.")
    if eval_logger is not None and metrics_callback is not None:
        raise ValueError(
            "Pass one custom-metrics hook: eval_logger/eval_aggregator or metrics_callback, not both (both feed "
            "the same evaluation metrics)."
        )
    if eval_logger is not None and "eval_logger" not in accepted:
        raise TypeError(f"{owner} does not take eval_logger/eval_aggregator; {_alternative(accepted)}")
    if metrics_callback is not None and "metrics_callback" not in accepted:
        raise TypeError(
            f"{owner} does not take metrics_callback(rollouts), the IAC/MAAC hook that also runs on training "
            f"rollouts; {_alternative(accepted)}"
        )


def _alternative(accepted: tuple[MetricsHookName, ...]) -> str:
    if "eval_logger" in accepted:
        return (
            "pass eval_logger(*, agent_completions_turns, batch_items, prompts) and eval_aggregator(rows, *, "
            "num_turns) for custom evaluation metrics."
        )
    return "pass metrics_callback(rollouts) for custom metrics."


def eval_logger_metrics(eval_logger: Callable, eval_aggregator: Callable) -> EvalMetrics:
    """The `EvalMetrics` of CoMLRL's `eval_logger`/`eval_aggregator` pair (the raw `prompt` field as `prompts`)."""

    def rows(items: list, completions: list, prompts: list) -> list[dict[str, Any]]:
        return eval_logger(
            agent_completions_turns=completions, batch_items=items, prompts=[item.get("prompt") for item in items]
        )

    def reduce(all_rows: list[dict[str, Any]], num_turns: int) -> dict[str, float]:
        return eval_aggregator(all_rows, num_turns=num_turns)

    return EvalMetrics(rows, reduce)
