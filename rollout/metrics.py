"""Prometheus metrics of a rollout replica (dapo_rollout_*, and the held-out evaluation's dapo_eval_*)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollout.engines.base import Completion


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.tokens = Counter("dapo_rollout_generated_tokens", "Response tokens generated.", registry=r)
        self.samples = Counter("dapo_rollout_samples", "Samples generated.", registry=r)
        self.truncated = Counter("dapo_rollout_truncated_samples", "Samples cut at max tokens.", registry=r)
        self.tokens_per_second = Gauge("dapo_rollout_tokens_per_second", "Generation speed, last batch.", registry=r)
        self.batch_seconds = Histogram(
            "dapo_rollout_batch_seconds", "Engine call latency.", registry=r, buckets=buckets
        )
        self.reward_seconds = Histogram(
            "dapo_rollout_reward_seconds", "Scoring request latency.", registry=r, buckets=buckets
        )
        self.reward_failures = Counter(
            "dapo_rollout_reward_failures",
            "Scoring attempts that found the reward server down (the prompts are held and retried).",
            registry=r,
        )
        self.groups = Counter("dapo_rollout_groups_published", "Scored groups published.", registry=r)
        self._rounds(r)
        self.version = Gauge("dapo_rollout_weight_version", "Policy version of the weights held.", registry=r)
        self.sync_rounds = Counter("dapo_rollout_sync_rounds", "Weight broadcasts received and verified.", registry=r)
        self.sync_failures = Counter(
            "dapo_rollout_sync_failures", "Weight broadcasts or groups that failed.", registry=r
        )
        self.sync_rejected = Counter(
            "dapo_rollout_sync_rejected",
            "Weight-sync manifests or rounds refused: a wrong MAC, or a manifest that does not fit the model.",
            registry=r,
        )
        self.sync_receive_seconds = Histogram(
            "dapo_rollout_sync_receive_seconds", "Seconds to receive a version.", registry=r, buckets=buckets
        )
        self.eval_avg = Gauge("dapo_eval_avg_at_k", "Held-out mean accuracy over k samples.", registry=r)
        self.eval_pass = Gauge("dapo_eval_pass_at_k", "Held-out fraction of prompts with a correct sample.", registry=r)
        self.eval_task_avg = Gauge(
            "dapo_eval_task_avg_at_k", "Held-out mean accuracy over k samples, per task.", ["task"], registry=r
        )
        self.eval_version = Gauge("dapo_eval_version", "Policy version of the last held-out evaluation.", registry=r)
        self.eval_seconds = Gauge("dapo_eval_seconds", "Wall time of the last held-out evaluation.", registry=r)
        self.in_flight = Gauge(
            "dapo_rollout_sequences_in_flight", "Sequences in the engine (continuous batching).", registry=r
        )
        self.idle_seconds = Counter("dapo_rollout_idle_seconds", "Seconds with no sequence in the engine.", registry=r)
        self.idle_fraction = Gauge(
            "dapo_rollout_idle_fraction", "Share of the last minute with no sequence in the engine.", registry=r
        )
        self.weight_serve_seconds = Histogram(
            "dapo_rollout_weight_serve_seconds",
            "Seconds from a version's "
            "announcement (broadcast round, or snapshot written) to the engine "
            "sampling with it.",
            registry=r,
            buckets=buckets,
        )
        self.versions_per_sample = Histogram(
            "dapo_rollout_versions_per_sample",
            "Policy versions that sampled one response's tokens.",
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 16),
        )
        self.multi_version_samples = Counter(
            "dapo_rollout_multi_version_samples",
            "Samples whose tokens span more than one policy version (weights loaded in flight).",
            registry=r,
        )
        self.weight_load_seconds = Histogram(
            "dapo_rollout_weight_load_seconds", "Seconds to load weights into the engine.", registry=r, buckets=buckets
        )

        self._episode_metrics(r)

    def _rounds(self, r: CollectorRegistry) -> None:
        """Groups sampled in rounds (rollout/rounds.py)."""
        sizes = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
        self.group_drawn = Histogram(
            "dapo_rollout_group_samples_drawn",
            "Samples drawn per group sampled in rounds (a task with a budget), down-sampled ones included.",
            registry=r,
            buckets=sizes,
        )
        self.group_rounds = Histogram(
            "dapo_rollout_group_rounds",
            "Rounds per group sampled in rounds.",
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 16),
        )
        self.given_up = Counter(
            "dapo_rollout_groups_given_up",
            "Groups given up after their first round agreed (a budget's give_up).",
            registry=r,
        )
        self.down_sampled = Counter(
            "dapo_rollout_samples_down_sampled",
            "Samples drawn and left out of their group (the balanced rule).",
            registry=r,
        )

    def _episode_metrics(self, r: CollectorRegistry) -> None:
        """Episodes against the environment service (rollout/episode_runner.py)."""
        self.episodes = Counter(
            "dapo_rollout_episodes",
            "Episodes finished: done (the environment ended it), max_turns, max_tokens (cut: truncated), failed "
            "(the environment failed; begun again or dead-lettered).",
            ["env", "ended"],
            registry=r,
        )
        self.episode_turns = Histogram(
            "dapo_rollout_episode_turns",
            "Model turns per finished episode.",
            ["env"],
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
        )
        self.tool_calls = Counter(
            "dapo_rollout_tool_calls",
            "Tool calls in episodes: valid, malformed, unknown, failed.",
            ["outcome"],
            registry=r,
        )
        self.env_step_seconds = Histogram(
            "dapo_rollout_env_step_seconds",
            "Latency of one environment call (reset or step) seen by the replica.",
            ["kind"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.episode_seconds = Counter(
            "dapo_rollout_episode_seconds",
            "Seconds episodes spent waiting for their environment (env) and in the engine (generate).",
            ["phase"],
            registry=r,
        )
        self.episodes_live = Gauge("dapo_rollout_episodes_live", "Episodes begun and not finished.", registry=r)

    def answered(self, outs: Sequence[Sequence[Completion]]) -> None:
        """Count single-turn samples (samples, truncations) as their groups finish; their tokens are counted as
        the engine returns them."""
        self.samples.inc(sum(len(o) for o in outs))
        self.truncated.inc(sum(c.finish_reason == "length" for o in outs for c in o))
