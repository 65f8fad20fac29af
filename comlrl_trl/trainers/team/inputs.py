"""The keywords every team trainer takes, declared once.

`TeamKwargs` lists the arguments that the team families share after `agent_model` (MAGRPO and its variants,
IAC/MAAC, MADPO, MARLHF and its RL stage). A family's `__init__` declares only its own arguments and takes the
shared ones as `**team_kwargs: Unpack[TeamKwargs]`, which it passes on; `team_init` gives that `__init__` its full
signature (for `help()`, `inspect.signature` and IDEs) and refuses an unknown keyword with a TypeError that names it.
The arguments' meanings are documented once, in [`MAGRPOTrainer`]'s docstring.
"""

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback


class TeamKwargs(TypedDict, total=False):
    """The shared keyword-only arguments of every team trainer, in their documented order; each defaults to None."""

    agents: Sequence[str | PreTrainedModel] | None
    num_agents: int | None
    tokenizer: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase] | None
    formatters: Callable | Sequence[Callable] | None
    reward_func: Callable | None
    reward_processor: Callable[[float], float] | None
    train_dataset: Dataset | IterableDataset | None
    eval_dataset: Dataset | IterableDataset | None
    args: Any
    external_transition: Callable | None
    wandb_config: dict[str, Any] | None
    eval_logger: Callable | None
    eval_aggregator: Callable | None
    metrics_callback: Callable | None
    peft_config: Any
    callbacks: list[TrainerCallback] | None


TEAM_KEYWORDS: tuple[str, ...] = tuple(TeamKwargs.__annotations__)


def team_inputs(team_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every shared keyword with its value in `team_kwargs` (None where it was not given), in documented order."""
    return {name: team_kwargs.get(name) for name in TEAM_KEYWORDS}


def check_team_kwargs(
    owner: str, team_kwargs: dict[str, Any], own: Sequence[str] = (), shared: Sequence[str] = TEAM_KEYWORDS
) -> None:
    """Raise a TypeError naming the first keyword of `team_kwargs` that `owner` does not take (neither one of the
    `shared` keywords nor one of its `own`), with the closest name it takes when one is close."""
    known = [*shared, *own]
    for name in team_kwargs:
        if name not in shared:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {', '.join(known)}."
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}{hint}")


def team_init(init: Callable | None = None, *, without: Sequence[str] = (), shown_kwargs: bool = False) -> Callable:
    """Decorate a team trainer's `__init__(self, [agent_model,] *, <own keywords>, **team_kwargs: Unpack[TeamKwargs])`.

    The decorated `__init__` refuses an unknown keyword (`check_team_kwargs`) before any work, and its signature is
    the full one, in the documented order: `agent_model`, the shared keywords (`TeamKwargs`, keyword-only, default
    None), then the family's own keyword-only arguments. `without` names shared keywords the family does not take
    (refused like unknown ones); `shown_kwargs` keeps `**kwargs` at the end of the signature, where the API the
    family mirrors documents it.
    """
    if init is None:
        return functools.partial(team_init, without=without, shown_kwargs=shown_kwargs)
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    variadic = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    if len(variadic) != 1:
        raise TypeError(f"{init.__qualname__} must take the shared keywords as **team_kwargs.")
    redeclared = sorted({p.name for p in params} & set(TEAM_KEYWORDS))
    if redeclared:
        raise TypeError(
            f"{init.__qualname__} redeclares the shared keywords {redeclared}; take them in **team_kwargs."
        )
    taken = [name for name in TEAM_KEYWORDS if name not in without]
    shared = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=TeamKwargs.__annotations__[name]
        )
        for name in taken
    ]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    own_keywords = [p for p in params if p.kind is p.KEYWORD_ONLY]
    leading = [p for p in own_keywords if p.name == "agent_model"]  # a keyword-only agent_model still comes first
    trailing = [p for p in own_keywords if p.name != "agent_model"]
    full = signature.replace(
        parameters=[*positional, *leading, *shared, *trailing, *(variadic if shown_kwargs else [])]
    )
    own_names = [p.name for p in own_keywords]
    not_shared = {*own_names, *(p.name for p in positional)}

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        shared_kwargs = {name: value for name, value in kwargs.items() if name not in not_shared}
        check_team_kwargs(type(self).__name__, shared_kwargs, own_names, taken)
        return init(self, *args, **kwargs)

    checked_init.__signature__ = full
    return checked_init
