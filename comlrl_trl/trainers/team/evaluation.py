"""Evaluation of a team trainer: one path per evaluation item (one response per agent per turn), scored with the
joint reward, with the discounted returns and the user's custom metrics."""

import itertools

from accelerate.utils import gather_object

from ...batching import even_shard


class TeamEvaluation:
    """The evaluation half of [`MAGRPOTrainer`]; it needs the trainer's `agent_trainers`, `orchestrator`, `args`,
    `eval_dataset`, `eval_metrics` (see `metrics_hooks`), `env_step`, `accelerator` and `log`."""

    def _maybe_evaluate(self, first_item: int, num_items: int) -> None:
        interval = self.args.eval_interval
        if interval > 0 and self.eval_dataset is not None:
            if any(index % interval == 0 for index in range(first_item, first_item + num_items)):
                self.evaluate()

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Sample one response per agent for the first `num_eval_samples` evaluation items and score them.

        Every item follows one path: one response per agent per turn, with the external transition between
        turns. Returns `eval/turn_k/reward_mean` and `eval/turn_k/expected_return` (the discounted return from
        turn k) for every turn k, plus the custom metrics (`eval_logger`/`eval_aggregator` or `metrics_callback`),
        or `{}` without an eval_dataset. An evaluation set that yields no item is a ValueError. Model weights are
        not updated.

        Each item's rewards are kept in `last_eval_rewards` (`[item][turn]`, this process's items, in the order the
        `eval_logger` sees them), for a per-sample record such as `recipes/evaluate.py`'s.
        """
        if self.eval_dataset is None:
            return {}
        count = self.args.eval_num_samples if num_eval_samples is None else num_eval_samples
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_eval_samples must be a positive integer, got {count!r}.")
        items = list(itertools.islice(iter(self.eval_dataset), count))
        if not items:
            raise ValueError(
                "eval_dataset yielded no evaluation items; pass a non-empty eval_dataset, or None to skip evaluation."
            )
        process, processes = self.accelerator.process_index, self.accelerator.num_processes
        indices, kept = even_shard(len(items), process, processes)  # the repeated ones' results are dropped
        sampled = [items[index] for index in indices]
        labels = [f"evaluation item {index}" for index in indices]
        local = sampled[:kept]
        completions = [[] for _ in self.agent_trainers]  # [agent][local item][turn]
        prompts = [[] for _ in self.agent_trainers]  # [agent][local item][turn]
        rewards, returns = [], []  # [local item][turn]
        training = [agent.model.training for agent in self.agent_trainers]
        try:
            for agent in self.agent_trainers:
                agent.model.eval()
            for start in range(0, len(sampled), self.args.eval_batch_size):
                end = start + self.args.eval_batch_size
                batch_completions, batch_rewards, batch_returns, batch_prompts = self.orchestrator.evaluate_path(
                    sampled[start:end], labels[start:end]
                )
                for agent_completions, new in zip(completions, batch_completions):
                    agent_completions.extend(new)
                for agent_prompts, new in zip(prompts, batch_prompts):
                    agent_prompts.extend(new)
                rewards.extend(batch_rewards)
                returns.extend(batch_returns)
        finally:
            for agent, was_training in zip(self.agent_trainers, training):
                agent.model.train(was_training)
                agent.metrics("eval").clear()
        completions, prompts = [c[:kept] for c in completions], [p[:kept] for p in prompts]
        self.last_eval_rewards = [list(turns) for turns in rewards[:kept]]
        metrics = {}
        all_rewards = self._gather_lists(rewards[:kept])
        all_returns = self._gather_lists(returns[:kept])
        for turn in range(self.args.num_turns):
            metrics[f"eval/turn_{turn + 1}/reward_mean"] = sum(r[turn] for r in all_rewards) / len(all_rewards)
            metrics[f"eval/turn_{turn + 1}/expected_return"] = sum(r[turn] for r in all_returns) / len(all_returns)
        custom = self._custom_eval_metrics(local, completions, prompts)
        metrics.update({f"eval/{key}": value for key, value in custom.items()})
        self.log({"env_step": self.env_step, **metrics})
        return metrics

    def _custom_eval_metrics(self, items: list, completions: list, prompts: list) -> dict[str, float]:
        """The custom metrics hook (`eval_metrics`): rows for the local items, gathered, then reduced (no prefix)."""
        if self.eval_metrics is None:
            return {}
        rows = self.eval_metrics.rows(items, completions, prompts)
        return self.eval_metrics.reduce(self._gather_lists(rows), self.args.num_turns)

    def _gather_lists(self, values: list) -> list:
        """Concatenate a list from every process, in process order.

        Plain `gather_object`, not `gather_for_metrics`: the latter trims to the remainder of whichever data
        loader is at its end (the training loader, during a rollout), which would drop real values here.
        """
        return gather_object(list(values))
