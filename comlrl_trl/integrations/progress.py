"""Readable progress for multi-agent training: one bar with the joint reward, one short line per log."""

import contextlib
import logging as std_logging
import sys
import warnings

from transformers import TrainerCallback
from transformers.utils import logging


logger = logging.get_logger(__name__)

# The metrics worth a glance, in the order they are shown.
_HEADLINE = (
    "turn_1/reward_mean",
    "turn_1/expected_return",
    "loss",
    "turn_1/reference_kl_mean",
    "critic/value_loss",
    "preference/pairs",
    "reward_model/accuracy",
    "reward_model/loss",
)


class TeamProgressCallback(TrainerCallback):
    """A progress bar over optimiser steps showing the latest joint reward, and a compact line per log.

    It replaces transformers' `ProgressCallback`, which prints every logged key (dozens per agent). While the bar is
    open, its lines, the messages of Python's and transformers' loggers and Python's warnings are written above the
    bar (`tqdm.write`), never glued to it.
    """

    def __init__(self):
        self.bar = None
        self._redirect = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=state.max_steps, initial=state.global_step, desc="training", unit="step", dynamic_ncols=True
            )
            self._redirect = contextlib.ExitStack()
            loggers = [std_logging.getLogger(), std_logging.getLogger("transformers")]  # the root, and transformers'
            self._redirect.enter_context(logging_redirect_tqdm(loggers, tqdm_class=type(self.bar)))
            self._redirect.enter_context(_warnings_above(type(self.bar)))

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        line = format_log_line(logs, state.global_step)
        if line is None:
            return
        if self.bar is not None:
            reward = logs.get("turn_1/reward_mean")
            if reward is not None:
                self.bar.set_postfix(reward=f"{reward:.3f}", env_step=logs.get("env_step"), refresh=False)
            self.bar.write(line)
        else:
            print(line)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Close the bar (also when training stopped with an error, so it is not printed again at exit)."""
        if self._redirect is not None:
            self._redirect.close()  # the loggers write to their own streams again
            self._redirect = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextlib.contextmanager
def _warnings_above(tqdm_class):
    """Print Python's warnings with `tqdm_class.write` while the bar is open.

    Only where warnings are printed the standard way: a recording `warnings.catch_warnings(record=True)` (pytest's
    included) or a custom `warnings.showwarning` is left alone.
    """
    standard = getattr(warnings, "_showwarnmsg_impl", None)
    if getattr(standard, "__module__", None) != "warnings" or warnings.showwarning is not warnings._showwarning_orig:
        yield
        return

    def write(message) -> None:
        file = message.file if message.file is not None else sys.stderr
        tqdm_class.write(warnings._formatwarnmsg(message).rstrip("\n"), file=file)

    warnings._showwarnmsg_impl = write
    try:
        yield
    finally:
        if warnings._showwarnmsg_impl is write:
            warnings._showwarnmsg_impl = standard


def format_log_line(logs: dict, step: int) -> str | None:
    """`step 12 | env_step 48 | reward 0.812 | ...` for training logs, `eval | ...` for evaluation logs."""
    if any(key.startswith("eval/") for key in logs):
        parts = [
            f"{key[len('eval/') :]} {value:.4g}"
            for key, value in logs.items()
            if key.startswith("eval/") and isinstance(value, (int, float))
        ]
        return f"eval at env_step {logs.get('env_step', '?')} | " + " | ".join(parts)
    if "env_step" not in logs:
        if "train_runtime" in logs:
            return f"done in {logs['train_runtime']:.1f} s"
        return None
    parts = [f"step {step}", f"env_step {logs['env_step']}"]
    parts += [
        f"{key.replace('/reward_mean', ' reward').replace('/expected_return', ' return')} {logs[key]:.4g}"
        for key in _HEADLINE
        if key in logs
    ]
    turns = sorted({key.split("/")[0] for key in logs if key.startswith("turn_") and key != "turn_1"} - {"turn_1"})
    parts += [f"{turn} reward {logs[f'{turn}/reward_mean']:.4g}" for turn in turns if f"{turn}/reward_mean" in logs]
    return " | ".join(parts)
