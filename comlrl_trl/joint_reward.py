"""The joint reward contract: how trainers call the user's reward function and check what it returns, and the
reward processors applied to every value it returns (documented at `comlrl_trl.utils.reward_processor`)."""

import inspect
import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any


_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def accepts_keyword(func: Callable, name: str) -> bool:
    """Whether `func` takes the keyword `name` (explicitly or through `**kwargs`).

    The documented contracts have exactly one optional keyword each (`batch_items` for reward functions,
    `external_prompts` for formatters); this is the only signature inspection the library does.
    """
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature take what they take
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class RewardProcessors:
    """Factories of `float -> float` reward transforms, passed to trainers as `reward_processor`.

    Import them from their documented path, `comlrl_trl.utils.reward_processor` (CoMLRL's
    `comlrl.utils.reward_processor`).

    >>> RewardProcessors.scale(factor=10.0)(0.5)
    5.0
    >>> RewardProcessors.shift(value=-1.0)(0.5)
    -0.5
    """

    @staticmethod
    def scale(factor: float = 1.0) -> Callable[[float], float]:
        """Multiply every reward by `factor`."""
        return lambda reward: reward * factor

    @staticmethod
    def shift(value: float = 0.0) -> Callable[[float], float]:
        """Add `value` to every reward."""
        return lambda reward: reward + value


class JointReward:
    """Calls `reward_func(*agent_completions[, batch_items=[item]])` for one task item and validates the result.

    `agent_completions` holds one list per agent, in actor order; position j of every list is joint action j.
    The function must return one real number per joint action. `reward_processor` is applied to each value.
    """

    def __init__(self, reward_func: Callable, reward_processor: Callable[[float], float] | None = None):
        if not callable(reward_func):
            raise TypeError(
                f"reward_func must be a callable returning one reward per joint action, got {type(reward_func).__name__}."
            )
        if reward_processor is not None and not callable(reward_processor):
            raise TypeError(
                f"reward_processor must be a callable float -> float, got {type(reward_processor).__name__}."
            )
        self.reward_func = reward_func
        self.reward_processor = reward_processor
        self.pass_batch_items = accepts_keyword(reward_func, "batch_items")

    def __call__(
        self, agent_completions: Sequence[Sequence[str]], item: dict[str, Any], item_label: str
    ) -> list[float]:
        num_joint = len(agent_completions[0])
        rewards = self.values(agent_completions, item, item_label)
        if len(rewards) != num_joint:
            raise ValueError(
                f"reward_func returned {len(rewards)} values for {item_label}, expected {num_joint} "
                f"(one per joint action). Item: {_short(item)}"
            )
        return rewards

    def values(self, agent_completions: Sequence[Sequence[str]], item: dict[str, Any], item_label: str) -> list[float]:
        """Call the reward function; return its values, checked and processed, whatever their count."""
        kwargs = {"batch_items": [item]} if self.pass_batch_items else {}
        try:
            raw = self.reward_func(*agent_completions, **kwargs)
        except Exception as error:
            error.add_note(f"comlrl_trl: raised by reward_func on {item_label}: {_short(item)}")
            raise
        rewards = _as_list(raw, item_label)
        processed = []
        for j, value in enumerate(rewards):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(
                    f"reward_func returned {type(value).__name__} {value!r} at position {j} for {item_label}; "
                    "rewards must be real numbers."
                )
            value = float(value)
            if self.reward_processor is not None:
                value = self._process(value, j, item, item_label)
            if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
                raise ValueError(
                    f"reward for joint action {j} of {item_label} is {value} (after reward_processor); rewards must "
                    f"be finite in float32 (|r| <= {_FLOAT32_MAX:.3g}), the precision returns and advantages are "
                    f"computed in. Clip or rescale the reward (e.g. reward_processor=RewardProcessors.scale(...)). "
                    f"Item: {_short(item)}"
                )
            processed.append(value)
        return processed

    def _process(self, value: float, j: int, item: dict[str, Any], item_label: str) -> float:
        try:
            return float(self.reward_processor(value))
        except Exception as error:
            error.add_note(
                f"comlrl_trl: raised by reward_processor on reward {value!r} of joint action {j} of "
                f"{item_label}: {_short(item)}"
            )
            raise


def _as_list(raw: Any, item_label: str) -> list:
    if hasattr(raw, "tolist"):  # torch tensors and numpy arrays
        raw = raw.tolist()
    if isinstance(raw, (list, tuple)):
        return [v.item() if hasattr(v, "item") else v for v in raw]
    raise TypeError(
        f"reward_func must return a list of numbers (one per joint action), got {type(raw).__name__} for {item_label}."
    )


def _short(item: dict[str, Any], limit: int = 200) -> str:
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 3] + "..."
