"""Settings of the learner (env DAPO_*, or --flags). Defaults are the DAPO paper's where it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator

from services.dtype import DtypeChoice
from services.settings import RedisSettings, ServiceSettings

RENAMED = {"seq-tis": "seq-geo-tis"}  # an off-policy mode's old name (in an old preset) -> its name now


class LearnerSettings(ServiceSettings, RedisSettings):
    port: int = Field(8002, ge=0, le=65535, description="HTTP port (health, metrics).")
    model_dir: Path = Field(Path(".dapo/models/smollm2-135m-instruct"), description="HF model folder (safetensors).")
    run_dir: Path = Field(Path(".dapo/learner"), description="Checkpoints, HF exports, state and ledger.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    dtype: DtypeChoice = Field(
        "auto",
        description="Compute dtype: bf16 (DeepSpeed bf16: bf16 weights and matmuls, fp32 master weights and optimizer "
        "state) where the hardware has it (auto), or fp32. Log-softmax, loss, advantages and IS ratios are fp32.",
    )
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate (DAPO: 1e-6).")
    warmup_batches: int = Field(
        20, ge=0, description="Linear LR warm-up, in trained batches = rollout steps (DAPO: 20); 0: none."
    )
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After the warm-up (DAPO: constant).")
    lr_decay_batches: int | None = Field(
        None,
        ge=1,
        description="Cosine: batches to decay over after the warm-up (unset: --max-batches minus the warm-up, so "
        "the last batch reaches --lr-min-ratio's end of the curve, as get_cosine_schedule_with_warmup).",
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Cosine: the final LR as a fraction of --lr.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (DAPO: 0.1).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip (DAPO: 1.0).")
    minibatches: int = Field(16, ge=1, description="Optimizer steps per TrainBatch (DAPO: 16).")
    micro_batch_tokens: int = Field(
        1024,
        ge=0,
        description="Token budget of one forward/backward: samples sorted by length, packed while rows x longest "
        "<= budget (0: fixed --micro-batch-size rows, in shuffled order).",
    )
    micro_batch_size: int = Field(64, ge=1, description="Samples per forward/backward at most.")
    logprob_chunk: int = Field(
        1024, ge=1, description="Positions per chunk of lm_head + log-softmax (memory grows with it, not the batch)."
    )
    attention: Literal["eager", "sdpa"] = Field(
        "eager",
        description="transformers attention kernel. eager: measured 1.7x faster per bf16 fwd+bwd than sdpa (flash "
        "attention for CPU) on SmolLM2's shapes at 100-token rows on these CPUs; sdpa for long sequences on GPUs.",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (unset: OMP_NUM_THREADS or torch's).")
    cpu_cores: str | None = Field(
        None, description="Pin the process to these CPU cores, e.g. '0' or '0-1' (beside a replica: its own core)."
    )
    lora_rank: int | None = Field(
        None,
        ge=1,
        description="Train a LoRA adapter of this rank (peft) instead of every weight: only the adapter trains, holds "
        "optimizer state, is checkpointed and is sent to the replicas (unset: full fine-tuning).",
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA alpha: the update is (alpha / rank) B A (unset: 2 x rank)."
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout on the adapter's input (training passes only)."
    )
    lora_targets: str = Field(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        pattern=r"^[A-Za-z0-9_.]+(,[A-Za-z0-9_.]+)*$",
        description="Modules that get an adapter, comma-separated names (peft's target_modules; the default: a "
        "Llama's seven projections, what vLLM serves adapters on).",
    )
    clip_low: float = Field(0.2, gt=0, lt=1, description="epsilon_low of clip-higher.")
    clip_high: float = Field(0.28, gt=0, description="epsilon_high of clip-higher (= clip_low: no clip-higher).")
    clip_c: float = Field(3.0, gt=1, description="Dual-clip bound c for negative advantages.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean",
        description="Loss aggregation: token-mean (DAPO: / the mini-batch's loss tokens), seq-mean-token-mean (GRPO: "
        "each sample's token mean / the samples with a loss token), seq-mean-token-sum-norm (Dr.GRPO: / samples x "
        "--max-response-tokens, a constant).",
    )
    max_response_tokens: int | None = Field(
        None,
        ge=1,
        description="The rollouts' generation budget L_max: Dr.GRPO's constant divisor (seq-mean-token-sum-norm). "
        "dapo-mesh up sets it from [mesh] max_response_tokens.",
    )
    normalize_std: bool = Field(True, description="Divide advantages by the group std (False: Dr.GRPO).")
    overlong_filter: bool = Field(False, description="Mask truncated samples out of the loss.")
    off_policy: Literal["off", "token-tis", "token-mask", "seq-geo-tis"] = Field(
        "off",
        description="Correction of stale samples, weight pi_prox/pi_behav (learner/offpolicy.py): off, "
        "token-tis (truncated at C), token-mask (0 outside [1/C, C]), seq-geo-tis (the geometric mean of a "
        "sample's token weights, truncated at C; was seq-tis).",
    )
    off_policy_cap: float = Field(2.0, gt=1, description="C of the off-policy correction.")
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Bound on a group's version lag when it is trained (the buffer checks it when it "
        "batches; versions move on meanwhile). Unset: no bound at the update.",
    )
    stale_groups: Literal["drop", "reweight"] = Field(
        "drop",
        description="A group past --max-staleness at the update: drop it (recorded in dapo:dropped), or "
        "train it under the off-policy correction (needs --off-policy).",
    )
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint (and acknowledge) every n batches.")
    keep_checkpoints: int = Field(2, ge=1, description="DeepSpeed checkpoints kept on disk.")
    hf_export: bool = Field(
        True,
        description="Write an HF safetensors export after every batch (run_dir/hf: the filesystem weight transport).",
    )
    weight_sync: Literal["broadcast", "none"] = Field(
        "broadcast", description="broadcast: send every version to the live replicas (gloo on CPU, NCCL on GPU)."
    )
    sync_host: str = Field("127.0.0.1", description="Address replicas use to reach the learner's sync rendezvous.")
    sync_bind_host: str | None = Field(
        None, description="Interface the rendezvous store listens on (unset: the address of --sync-host)."
    )
    sync_secret: SecretStr | None = Field(
        None, description="Key of the weight sync's MACs, shared with the replicas (unset: the auth token)."
    )
    sync_port: int = Field(29600, ge=0, le=65535, description="Rendezvous port of the weight sync (0: a free port).")
    sync_timeout_s: float = Field(60.0, gt=0, description="A replica that does not answer a sync this long is dropped.")
    sync_join_s: float = Field(
        10.0,
        gt=0,
        description="Join window: an invited replica that has not joined a new broadcast group this long after the "
        "announcement is left out of it (set aside, invited again later), so one that cannot join stalls the learner "
        "this long, not sync_timeout_s. A live replica joins within a second.",
    )
    sync_max_members: int = Field(
        0,
        ge=0,
        description="Most replicas in the broadcast group (0: every live one). The others load the learner's HF "
        "snapshots (they need --weights-dir): a gloo group's formation grows with the square of its members.",
    )
    sync_bucket_mb: float = Field(64.0, gt=0, description="Size of the flat buckets weights are broadcast in.")
    keep_batches: int = Field(16, ge=0, description="Acknowledged batches kept in dapo:batches after a checkpoint.")
    consumer_name: str = Field("learner-0", description="Consumer name in the batches stream's group.")
    claim_idle_ms: int = Field(60_000, ge=0, description="Reclaim batches another learner left idle this long.")
    max_deliveries: int = Field(5, ge=1, description="A batch delivered more often goes to the dead letters.")
    max_batches: int | None = Field(
        None, ge=1, description="Stop once the weights hold this many batches (counted over restarts: the version)."
    )
    hold_after_max: bool = Field(
        False, description="After --max-batches: keep serving metrics and the sync group until SIGTERM (dapo-mesh up)."
    )
    seed: int = Field(0, description="Seed of the mini-batch shuffling (each batch's from the seed and its version).")
    record_batches: bool = Field(
        False,
        description="Write every batch as trained to run_dir/batches/<version>.msgpack (and the update settings): "
        "`dapo-mesh replay` trains them again offline.",
    )
    record_episodes: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the trained groups (and of those dropped as stale at the update) written token by token "
        "to run_dir/episodes/ for `dapo-mesh view`: text, token ids, behaviour and learner log-probs, versions, "
        "loss mask (0: none; chosen by a hash of the group id).",
    )
    record_episodes_mb: float = Field(
        256.0, gt=0, description="Recording stops once run_dir/episodes/ holds this much (said in its meta.json)."
    )
    ranks: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks on this machine: the learner execs torchrun with this many processes (rank 0 "
        "serves; all train). Across machines run torchrun yourself (--nnodes): docs, services/learner-ranks.md.",
    )
    dist_port: int = Field(0, ge=0, le=65535, description="torch.distributed port for a single process (0: free).")
    dist_timeout_s: float = Field(
        600.0,
        gt=0,
        description="N ranks: the longest a rank waits in a collective (the other ranks wait in one while rank 0 "
        "exports, syncs the replicas and checkpoints); a dead rank fails the others after it at most.",
    )

    @property
    def lora_target_list(self) -> list[str]:
        return self.lora_targets.split(",")

    @model_validator(mode="after")
    def _reweight_needs_a_correction(self) -> Self:
        if self.max_staleness is not None and self.stale_groups == "reweight" and self.off_policy == "off":
            raise ValueError(
                "stale_groups reweight: set off_policy (token-tis, token-mask or seq-geo-tis) to reweight with"
            )
        return self

    @field_validator("off_policy", mode="before")
    @classmethod
    def _renamed(cls, v: object) -> object:
        if isinstance(v, str) and v in RENAMED:
            raise ValueError(
                f"off_policy {v!r} is now {RENAMED[v]!r} (the geometric mean of a sample's token weights, not "
                "sequence-level IS): set that"
            )
        return v

    @model_validator(mode="after")
    def _capped_group_needs_snapshots(self) -> Self:
        if self.sync_max_members and (self.weight_sync != "broadcast" or not self.hf_export):
            raise ValueError(
                "sync_max_members caps the broadcast group: set weight_sync broadcast and keep hf_export on (the "
                "replicas left out of the group load its HF snapshots)"
            )
        return self

    @model_validator(mode="after")
    def _dr_grpo_has_a_budget(self) -> Self:
        if self.loss_agg == "seq-mean-token-sum-norm" and self.max_response_tokens is None:
            raise ValueError(
                "loss_agg seq-mean-token-sum-norm (Dr.GRPO) divides by a constant: set max_response_tokens (the "
                "rollouts' generation budget)"
            )
        return self

    @model_validator(mode="after")
    def _cosine_has_a_length(self) -> Self:
        if self.lr_schedule == "cosine" and self.lr_decay_batches is None and self.max_batches is None:
            raise ValueError("lr_schedule cosine: set lr_decay_batches (or max_batches) to say how long it decays")
        return self
