"""The actor-critic team trainer shared by IAC and MAAC.

It is the MAGRPO team (the team's loop driving one equal `AgentGRPOTrainer` per actor, the joint rollout tree) with three changes: advantages come from a critic (`ActorCriticOrchestrator`), the critics train on
the same micro-batches as the actors and step with them, and rewards may be per agent. TRL's clipped policy loss
is reused as it is; TRL removed its own PPO trainer in 1.13.
"""

from collections import defaultdict
from collections.abc import Sequence
from numbers import Real
from typing import Any, Unpack

import torch
from transformers import PreTrainedModel

from ...adapters.grpo import AgentGRPOTrainer, zero3_enabled
from ...adapters.helpers import call_save_model
from ...core.values import value_loss
from ...inputs import model_name
from ...value_models import CausalLMWithValueHead, value_positions
from ..team.inputs import TeamKwargs, team_init, team_inputs
from ..team.metrics_hooks import EvalMetrics, check_metrics_hooks
from ..team.trainer import TeamTrainer
from .ac_config import ActorCriticConfig
from .critic_loading import critic_load_kwargs, load_critic_backbone, place_critic
from .critics import critic_tokenizer
from .rollout import ActorCriticOrchestrator, AgentRewards, RolloutSample


_ACTOR_KEYS = ("dtype", "torch_dtype", "attn_implementation", "model_kwargs")


class ActorAgent(AgentGRPOTrainer):
    """An actor: TRL's policy loss, plus the value loss of its own value head when it has one (IAC with
    `use_separate_critic=False`), in one forward and one backward pass."""

    value_capture = None  # a ValueCapture when the actor carries a value head

    def compute_agent_loss(self, model, inputs):
        if self.value_capture is None or "value_targets" not in inputs:
            return super().compute_agent_loss(model, inputs)
        with self.value_capture.capture() as captured:
            loss = super().compute_agent_loss(model, inputs)
        all_values = torch.cat(captured)  # (B, T): the head at every position
        completion_mask = inputs["completion_mask"] if self.args.critic_type == "q" else None
        index = value_positions(inputs["prompt_ids"], completion_mask)
        values = all_values[torch.arange(all_values.size(0), device=all_values.device), index].float()
        vloss = value_loss(values, inputs["value_targets"], inputs["old_values"], self.args.value_clip_range)
        mode = "train" if self.model.training else "eval"
        self.metrics(mode)["value_loss"].append(self.accelerator.gather(vloss.detach()).mean().item())
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return loss + self.args.value_loss_coef * vloss / normalizer


class ActorCriticTrainer(TeamTrainer):
    """Shared construction, training, evaluation and saving of [`IACTrainer`] and [`MAACTrainer`]."""

    default_config_cls = ActorCriticConfig
    agent_cls = ActorAgent

    metrics_hooks = ("eval_logger", "metrics_callback")

    @team_init(without=("num_agents",))  # CoMLRL's IAC/MAAC take the agent count from args.num_agents
    def __init__(
        self,
        agent_model: str | PreTrainedModel | None = None,
        *,
        critic_model: str | PreTrainedModel | None = None,
        critics: Sequence[str | PreTrainedModel] | None = None,
        critic_peft_config: Any = None,
        model_config: dict[str, Any] | None = None,
        **team_kwargs: Unpack[TeamKwargs],
    ):
        inputs = team_inputs(team_kwargs)
        args, agents = inputs["args"], inputs["agents"]
        if args is None:
            args = self.default_config_cls()
        if not isinstance(args, self.default_config_cls):
            raise TypeError(f"args must be a {self.default_config_cls.__name__}, got {type(args).__name__}.")
        check_metrics_hooks(
            type(self).__name__,
            self.metrics_hooks,
            inputs["eval_logger"],
            inputs["eval_aggregator"],
            inputs["metrics_callback"],
        )
        if agents is not None and inputs["tokenizer"] is None:
            raise ValueError(
                f"{type(self).__name__} needs tokenizer=... when agents are given (even as model ids): one tokenizer "
                "for all agents or a list with one per agent."
            )
        critic_kwargs = self._apply_model_config(model_config, args)
        n = len(agents) if agents is not None else args.num_agents
        critic_sources = self._critic_sources(critic_model, critics, n, args)
        self._critic_setup = (critic_sources, critic_kwargs, critic_peft_config)  # built with the orchestrator
        super().__init__(agent_model, **{**team_kwargs, "args": args})

    # ----- construction -----

    def _build_orchestrator(self, formatters, joint, external_transition):
        self.critic_set = self._build_critics(*self._critic_setup)
        rewards = AgentRewards(joint.reward_func, joint.reward_processor, len(self.agent_trainers))
        return ActorCriticOrchestrator(
            self.agent_trainers,
            formatters,
            rewards,
            self.args,
            self.accelerator,
            self.critic_set,
            external_transition,
            record_samples=self.metrics_callback is not None,
        )

    def _apply_model_config(self, model_config, args) -> dict[str, Any]:
        """Actor loading settings go into `args.model_init_kwargs`; returns the critics' loading settings."""
        model_config = dict(model_config or {})
        allowed = set(_ACTOR_KEYS) | {"critic_model_kwargs"} | set(self._extra_model_config_keys)
        unknown = set(model_config) - allowed
        if unknown:
            raise ValueError(f"Unknown model_config keys {sorted(unknown)}; expected some of {sorted(allowed)}.")
        common = {
            key: model_config[key] for key in ("dtype", "torch_dtype", "attn_implementation") if key in model_config
        }
        if common or model_config.get("model_kwargs"):
            args.model_init_kwargs = {
                **(args.model_init_kwargs or {}),
                **common,
                **model_config.get("model_kwargs", {}),
            }
        self._model_config = model_config
        return {**common, **model_config.get("critic_model_kwargs", {})}

    _extra_model_config_keys: tuple[str, ...] = ()

    def _critic_sources(self, critic_model, critics, n: int, args) -> list:
        raise NotImplementedError

    def _build_critics(self, sources, critic_kwargs, critic_peft_config):
        raise NotImplementedError

    def _load_critic(self, source, critic_kwargs, peft_config, hidden_dim, tokenizer, label: str):
        """A critic from `source` with a fresh value head, and the tokenizer whose ids it reads: `tokenizer` (an
        actor's, for a critic fed that actor's ids), or with None the critic's own (`critic_tokenizer`)."""
        zero3 = zero3_enabled(self)
        kwargs = critic_load_kwargs(critic_kwargs, source, peft_config, zero3, bool(self.args.bf16))
        plugin = self.accelerator.state.deepspeed_plugin if zero3 else None
        model = load_critic_backbone(source, kwargs, label, plugin)  # under ZeRO-3: partitioned as it is created
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if tokenizer is None:
            tokenizer = critic_tokenizer(source, model, label)
        vocab = model.get_input_embeddings().num_embeddings
        if vocab < len(tokenizer):
            raise ValueError(
                f"{label} has {vocab} token embeddings but its tokenizer has {len(tokenizer)} tokens; a critic must "
                "accept the token ids it is fed (use a critic from the same model family as its actor)."
            )
        model = place_critic(model, self.accelerator.device)
        return CausalLMWithValueHead(model, hidden_dim), tokenizer

    # ----- training -----

    def critic_micro_step(self, slot: int) -> None:
        self.critic_set.train_micro_batches(
            slot, [agent.micro_batch(slot) for agent in self.agent_trainers], self._record_metric
        )

    def critic_optimizer_step(self) -> None:
        self.critic_set.step()

    def _record_metric(self, key: str, value: float, agent: int | None = None) -> None:
        """The critics' metric sink: a team metric, or agent `agent`'s (logged as `agent_i/key`)."""
        metrics = self._joint_metrics if agent is None else self.agent_trainers[agent].metrics("train")
        metrics[key].append(value)

    def generation_step(self, rows):
        super().generation_step(rows)
        if self.metrics_callback is not None:
            by_item = defaultdict(list)
            for sample in self.orchestrator.samples:
                by_item[sample.metadata["item_label"]].append(sample)
            rows = [_numeric(self.metrics_callback(samples)) for samples in by_item.values()]
            metrics = _mean_rows(self._gather_lists(rows))
            if metrics:
                self.log({"env_step": self.env_step, **metrics})

    # ----- evaluation -----

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Score the first `num_eval_samples` (default `args.eval_num_samples`) evaluation items, one response per
        agent per turn.

        Returns `eval/turn_k/reward_mean` and `eval/turn_k/expected_return` for every turn k, plus the
        custom metrics (`metrics_callback` values averaged over items, or `eval_aggregator`'s) with the `eval/` prefix,
        or `{}` without an eval_dataset.
        """
        return super().evaluate(num_eval_samples)

    def _build_eval_metrics(self, eval_logger, eval_aggregator, metrics_callback) -> EvalMetrics | None:
        """`metrics_callback` as the evaluation hook: each item's row is the callback's numbers on that item's
        samples (one per agent and turn), and the rows are averaged."""
        if metrics_callback is None:
            return super()._build_eval_metrics(eval_logger, eval_aggregator, metrics_callback)

        def rows(items, completions, prompts) -> list[dict[str, float]]:
            return [
                _numeric(metrics_callback(_item_samples(i, item, completions, prompts)))
                for i, item in enumerate(items)
            ]

        return EvalMetrics(rows, lambda all_rows, num_turns: _mean_rows(all_rows))

    # ----- saving and checkpoints -----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Export the actors to `output_dir/agent_i/`, the critics with their `value_head.pt` (see the class) and the
        sampling settings to `output_dir/team_settings.json`."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        call_save_model(super().save_model, output_dir, _internal_call)
        self.critic_set.save(output_dir)

    def save_team_extra_state(self, checkpoint: str) -> None:
        self.critic_set.save_state(checkpoint)  # every process: the critics' DeepSpeed engines write their shards

    def load_team_extra_state(self, checkpoint: str) -> None:
        self.critic_set.load(checkpoint)

    def compatibility(self) -> dict[str, Any]:
        return {
            **super().compatibility(),
            "critic_type": self.args.critic_type,
            "critics": list(self.critic_set.fingerprints),  # taken before DeepSpeed casts or partitions them
        }

    def _run_config(self) -> dict[str, Any]:
        return {
            **super()._run_config(),
            "critic_type": self.args.critic_type,
            "critic_learning_rate": self.args.critic_learning_rate,
            "value_loss_coef": self.args.value_loss_coef,
            "value_clip_range": self.args.value_clip_range,
            "discount": self.args.discount,
        }

    # ----- accessors -----

    @property
    def critics(self) -> list[CausalLMWithValueHead]:
        """The critic models (each with a `value_head`); empty when the heads sit on the actors."""
        return self.critic_set.critics


def _check_same_models(first, first_name: str, entries: Sequence, entries_name: str) -> None:
    expected = model_name(first)
    names = [model_name(entry) for entry in entries]
    if any(name != expected for name in names):
        raise ValueError(
            f"{first_name} and {entries_name} conflict: {expected!r} != {names}. Pass one of them, or "
            "the same model in both."
        )


def _critic_list(critics, what: str) -> list:
    if isinstance(critics, (str, PreTrainedModel)) or not isinstance(critics, Sequence) or len(critics) == 0:
        raise TypeError(f"{what} must be a non-empty list of model ids, paths or models.")
    if any(critic is None for critic in critics):
        raise ValueError(f"{what} entries must not be None.")
    return list(critics)


def _item_samples(i: int, item, completions: list, prompts: list) -> list[RolloutSample]:
    """The evaluation `RolloutSample`s of item `i` (completions and prompts are `[agent][item][turn]`)."""
    return [
        RolloutSample(
            a, prompts[a][i][t], completions[a][i][t], {"turn_idx": t, "generation_idx": 0, "batch_item": item}
        )
        for a in range(len(completions))
        for t in range(len(completions[a][i]))
    ]


def _numeric(row) -> dict[str, float]:
    if not isinstance(row, dict):
        raise TypeError(f"metrics_callback must return a dict of metric name -> number, got {type(row).__name__}.")
    return {key: float(value) for key, value in row.items() if isinstance(value, Real) and not isinstance(value, bool)}


def _mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    totals = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            totals[key].append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}
