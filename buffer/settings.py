"""Settings of the buffer (env DAPO_*, or --flags)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from services.datasets import DEFAULT_DATASET_CONFIG
from services.settings import RedisSettings, ServiceSettings


class BufferSettings(ServiceSettings, RedisSettings):
    port: int = Field(8003, ge=0, le=65535, description="HTTP port (health, metrics).")
    run_dir: Path = Field(Path(".dapo/buffer"), description="Where the evaluation split is written.")
    dataset: str = Field(
        "reasoning_gym:chain_sum",
        description="reasoning_gym:<task>[=weight,...] or file:<path.parquet|.jsonl>[@verifier][=weight] (verl / "
        "DAPO-Math-17k schema); several parts, separated by ';', mix by weight.",
    )
    dataset_size: int = Field(10_000, ge=1, description="reasoning-gym: items generated for training.")
    dataset_seed: int = Field(42, description="reasoning-gym: generator seed.")
    dataset_config: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_DATASET_CONFIG),
        description='reasoning-gym keyword arguments per task, JSON: {"chain_sum": {"max_terms": 2}}.',
    )
    prompt_template: Literal["dapo", "short", "none"] = Field(
        "short", description="dapo: DAPO-Math-17k instruction; short: question + Answer: hint; none: as is."
    )
    file_verifier: str | None = Field(
        None, description="Verifier of file rows that name none, where the file part names none (@verifier)."
    )
    eval_size: int = Field(200, ge=0, description="Held-out prompts, never dispatched for training.")
    shuffle_seed: int = Field(0, description="Seed of the per-epoch shuffle.")
    max_epochs: int | None = Field(None, ge=1, description="Stop dispatching after this many epochs.")
    n_samples: int = Field(8, ge=1, le=1024, description="G: samples per prompt (DAPO: 16).")
    batch_size: int = Field(8, ge=1, description="B: groups per TrainBatch (DAPO: 512).")
    max_staleness: int = Field(1, ge=0, description="Drop groups more than this many versions old.")
    dynamic_sampling: bool = Field(True, description="Keep only groups whose accuracy varies (DAPO).")
    dispatch_policy: Literal["uniform", "curriculum"] = Field(
        "uniform",
        description="uniform: every prompt in turn; curriculum: a prompt predicted to give a group that dynamic "
        "sampling drops is skipped with that probability (docs: services/curriculum.md).",
    )
    curriculum_explore: float = Field(
        0.1, ge=0, le=1, description="curriculum: the least chance of dispatching a prompt predicted to be filtered."
    )
    curriculum_streak_decay: float = Field(
        1.0,
        ge=0,
        le=1,
        description="curriculum: the chance is multiplied by this per group in a row that was filtered.",
    )
    curriculum_decay: float = Field(
        0.5, ge=0, le=1, description="Weight of a prompt's older groups in its pass rate, per newer group."
    )
    curriculum_prior: float = Field(
        0.5, gt=0, description="Strength (in samples) of the Beta(0.5·s, 0.5·s) prior of a prompt's pass rate."
    )
    curriculum_shared: Literal["none", "task", "difficulty"] = Field(
        "none",
        description="curriculum: what a prompt without history borrows its prediction from: nothing (always "
        "dispatched), the drop rate of its task's first groups, or of its task-and-difficulty class's (the "
        "difficulty attributes reasoning-gym's metadata names).",
    )
    curriculum_class_decay: float = Field(
        0.95, ge=0, le=1, description="curriculum: weight of a class's older first groups, per newer one."
    )
    sampling_rule: Literal["fixed", "signal", "balanced"] = Field(
        "fixed",
        description="How many samples each prompt gets (docs: services/sampling-budgets.md): fixed: n_samples in "
        "one round; signal: rounds until a right and a wrong answer, topped up to n_samples; balanced: rounds until "
        "n_samples/2 of each, down-sampled to n_samples.",
    )
    sampling_first: int | None = Field(
        None, ge=1, le=1024, description="signal/balanced: samples in a prompt's first round (unset: n_samples / 2)."
    )
    sampling_round: int | None = Field(
        None, ge=1, le=1024, description="signal/balanced: samples each later round adds (unset: sampling_first)."
    )
    sampling_most: int | None = Field(
        None, ge=1, le=1024, description="signal/balanced: samples drawn for a prompt at most (unset: 2 x n_samples)."
    )
    sampling_give_up: float = Field(
        0.5,
        ge=0,
        le=1,
        description="signal/balanced: the least chance of giving a prompt up when its first round agrees (more where "
        "its history, or its class's, predicts a group of n_samples uniform with more; 1: always).",
    )
    sampling_give_up_by: Literal["history", "cost"] = Field(
        "history",
        description="signal/balanced: what the give-up chance of an agreeing first round comes from: history: the "
        "prompt's (else its class's) prediction that a group of n_samples is uniform; cost: per task, 1 - "
        "sampling_explore where going on after such a round has cost more samples per trained one than the run "
        "pays on average, else sampling_give_up (both floored by sampling_give_up).",
    )
    sampling_explore: float = Field(
        0.1,
        ge=0,
        le=1,
        description="sampling_give_up_by = cost: the share of agreeing first rounds of a costly task still let go on "
        "(its cost keeps being counted as the policy moves).",
    )
    continuous_rewards: bool = Field(False, description="Filter on reward std instead of accuracy.")
    reward_std_threshold: float = Field(0.0, ge=0, description="With continuous rewards: keep if std > this.")
    degenerate_cap: int | None = Field(
        None, ge=1, description="Pause dispatch after this many filtered groups in a row (unset: never)."
    )
    degenerate_pause_s: float = Field(30.0, gt=0, description="How long a degenerate pause lasts.")
    trim_every_s: float = Field(30.0, ge=0, description="How often to trim acknowledged stream entries.")
    keep_prompts: int = Field(10_000, ge=0, description="Acknowledged prompts kept in dapo:prompts (history).")
    keep_rollouts: int = Field(256, ge=0, description="Acknowledged groups kept in dapo:rollouts (~70 KB each).")
    keep_dropped: int = Field(100_000, ge=0, description="Records kept in dapo:dropped (~150 B each; the audit).")
    record_episodes: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the dropped groups written with their samples to run_dir/episodes/ for `dapo-mesh view` "
        "(0: none; chosen by a hash of the group id).",
    )
    record_episodes_mb: float = Field(
        256.0, gt=0, description="Recording stops once run_dir/episodes/ holds this much (said in its meta.json)."
    )
    consumer_name: str = Field("buffer-0", description="Consumer name in the rollouts stream's group.")
    claim_idle_ms: int = Field(60_000, ge=0, description="Reclaim groups another buffer left idle this long.")
    lease_ttl_ms: int = Field(
        10_000,
        ge=100,
        description="One buffer leads (a lease in Redis, renewed every third of this); another waits this long "
        "after the leader stops without giving it up (kill -9, a partition) before it takes over.",
    )

    @model_validator(mode="after")
    def _budget_fits(self) -> Self:
        if self.sampling_rule == "fixed":
            return self
        if self.continuous_rewards:
            raise ValueError("sampling_rule: rounds look for right and wrong answers; continuous_rewards has none")
        if not self.dynamic_sampling:
            raise ValueError(
                "sampling_rule: a group given up or still uniform at its budget's end is dropped by dynamic sampling; "
                "with dynamic_sampling off it would be trained (set dynamic_sampling = true, or sampling_rule fixed)"
            )
        first, most = self.budget_first, self.budget_most
        if first > most or self.n_samples > most:
            raise ValueError(
                f"sampling_most {most} must be at least n_samples ({self.n_samples}) and sampling_first ({first})"
            )
        return self

    @property
    def budget_first(self) -> int:
        return self.sampling_first or max(1, self.n_samples // 2)

    @property
    def budget_most(self) -> int:
        return self.sampling_most or 2 * self.n_samples

    @property
    def prompts_per_slot(self) -> int:
        """Prompts dispatch keeps in flight per staleness slot of a batch: one with `fixed` (a prompt brings G
        samples); with a budget, G / the first round's size, so that the replica has a group's worth of samples to
        batch whatever the rule."""
        return 1 if self.sampling_rule == "fixed" else max(1, self.n_samples // self.budget_first)

    @model_validator(mode="after")
    def _curriculum_predicts_the_filter(self) -> Self:
        """The curriculum predicts DAPO's accuracy filter: without it (or with the reward-std filter) it would skip
        prompts for a verdict nothing makes."""
        if self.dispatch_policy == "curriculum" and (not self.dynamic_sampling or self.continuous_rewards):
            raise ValueError(
                "dispatch_policy curriculum predicts dynamic sampling's accuracy filter: it needs dynamic_sampling "
                "on and continuous_rewards off"
            )
        return self

    @field_validator("dataset_config", mode="before")
    @classmethod
    def _json(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v
