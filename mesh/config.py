"""The mesh's configuration: one typed `MeshConfig` for the whole run — the mesh's own section (scale, model,
transport, evaluation) and one section per service, each the service's own settings class — validated as a whole
before anything starts.

    cfg = MeshConfig.from_preset(Path("configs/dapo.toml"), run_dir=Path(".dapo"))
    cfg = MeshConfig.tiny_preset(Path(".dapo"), steps=3)                  # a random tiny Llama: a smoke test
    cfg.learner.clip_high                                          # 0.28: the preset's [learner] section

A preset is one TOML file:

    [mesh]                 # MeshConfig's own fields: steps, n_samples, batch_size, lr, ...
    [learner]              # LearnerSettings fields: clip_high, loss_agg, overlong_filter, ...
    [buffer]               # BufferSettings fields: dynamic_sampling, ...
    [reward]               # RewardSettings fields: overlong_shaping, ...
    [rollout]              # RolloutSettings fields: temperature, ...

A preset may start from another (`base = "../grpo.toml"`, relative to the file) and change a few keys:
configs/ablations/ climbs DAPO's Table 1 that way, one technique per file. Every key is checked against its
section's class and every value validated by it, so a typo fails before anything starts, with the section and the
field in the message. A service section holds what the preset says (`cfg.learner.model_fields_set`); the mesh's
own values (ports, paths, and what [mesh] decides for every service, `MESH_SETS`) are added when the command lines
are made (mesh/commands.py), and a section that sets one of those is refused: one value, one place. The sections
read no environment: the services themselves still read `DAPO_*` for what nobody set.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from buffer.settings import BufferSettings
from env_server.settings import EnvSettings
from learner.settings import LearnerSettings
from mesh.trackers import TrackingSettings
from reward_server.settings import RewardSettings
from rollout.settings import RolloutSettings
from router.settings import RouterSettings
from sandbox.settings import SandboxSettings
from services.child_process import ROOT
from services.schemas import CLIENT_SCORED
from services.settings import secret_fields

DEFAULT_PRESET = ROOT / "configs" / "dapo.toml"  # what `dapo-mesh up` runs without --config
Service = Literal["reward", "env", "buffer", "learner", "rollout", "router", "sandbox"]
SERVICES: tuple[Service, ...] = ("reward", "env", "buffer", "learner", "rollout", "router", "sandbox")


# set on each section itself: pydantic merges model_config along the bases, and the service's class (a later base)
# says extra="ignore"
_SECTION_CONFIG = SettingsConfigDict(extra="forbid", validate_assignment=True)


class _PresetSection(BaseSettings):
    """A service's settings as a preset section: the class's own fields and validators, filled only from the
    preset (no environment, no command line), and no key the class does not have."""

    model_config = _SECTION_CONFIG

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class RewardSection(_PresetSection, RewardSettings):
    model_config = _SECTION_CONFIG


class EnvSection(_PresetSection, EnvSettings):
    model_config = _SECTION_CONFIG


class BufferSection(_PresetSection, BufferSettings):
    model_config = _SECTION_CONFIG


class LearnerSection(_PresetSection, LearnerSettings):
    model_config = _SECTION_CONFIG


class RolloutSection(_PresetSection, RolloutSettings):
    model_config = _SECTION_CONFIG


class RouterSection(_PresetSection, RouterSettings):
    model_config = _SECTION_CONFIG


class SandboxSection(_PresetSection, SandboxSettings):
    model_config = _SECTION_CONFIG


SECTIONS: dict[Service, type[_PresetSection]] = {
    "reward": RewardSection,
    "env": EnvSection,
    "buffer": BufferSection,
    "learner": LearnerSection,
    "rollout": RolloutSection,
    "router": RouterSection,
    "sandbox": SandboxSection,
}

# What the mesh sets in each service, and from which [mesh] field (None: the mesh's wiring: ports, paths, URLs,
# ids): a service section may not set these. Everything else in a service's settings is the preset's to choose,
# but a secret, which travels in the environment only.
_WIRING: dict[str, str | None] = dict.fromkeys(["port", "host", "redis_url", "insecure", "run_dir", "model_dir"])
_FROM_MESH: dict[Service, dict[str, str | None]] = {
    "reward": {"sandbox_url": None},
    "env": {"sandbox_url": None},
    "buffer": {
        "dataset": "dataset",
        "n_samples": "n_samples",
        "batch_size": "batch_size",
        "max_staleness": "max_staleness",
    },
    "learner": {
        "max_batches": "steps",
        "minibatches": "minibatches",
        "lr": "lr",
        "dtype": "dtype",
        "weight_sync": "transport",
        "sync_port": None,
        "dist_port": None,
        "max_staleness": "max_staleness",
        "hold_after_max": None,
        "ranks": "learner_ranks",
        "max_response_tokens": "max_response_tokens",
        "lora_rank": "lora_rank",
    },
    "rollout": {
        "lora_max_rank": "lora_rank",
        "engine": "engine",
        "max_response_tokens": "max_response_tokens",
        "dtype": "dtype",
        "sync_broadcast": "transport",
        "reward_url": None,
        "env_url": None,
        "env_routes": None,
        "gateway_port": "gateway_port",
        "gateway_url": None,
        "weights_dir": None,
        "replica_id": None,
        "eval_every": "eval_every",
        "eval_data": None,
        "eval_size": "eval_size",
        "eval_tasks": "eval_tasks",
        "eval_k": "eval_k",
    },
    "router": {},
    "sandbox": {},
}
MESH_FIELD_OF: dict[Service, dict[str, str | None]] = {
    name: {k: v for k, v in (_WIRING | wants).items() if k in SECTIONS[name].model_fields}
    for name, wants in _FROM_MESH.items()
}
MESH_SETS: dict[Service, frozenset[str]] = {name: frozenset(keys) for name, keys in MESH_FIELD_OF.items()}
SECRETS: dict[Service, frozenset[str]] = {name: secret_fields(cls) for name, cls in SECTIONS.items()}


def _owned(name: Service, keys: list[str]) -> str:
    """Where each refused key is set instead: `lr` -> "[mesh] lr", `weight_sync` -> "[mesh] transport"."""
    said = []
    for k in keys:
        if k in SECRETS[name]:
            said.append(f"{k}: a secret, given in the environment (DAPO_{k.upper()}), never in a preset")
        elif (field := MESH_FIELD_OF[name][k]) is not None:
            said.append(f"{k}: set [mesh] {field}")
        elif k in ("env_url", "env_routes"):
            said.append(f"{k}: name your own environment servers in [mesh] env_servers = [{{url = ...}}]")
        else:
            said.append(f"{k}: the mesh's wiring")
    return "; ".join(said)


def _near(bad: list[str], allowed: set[str]) -> str:
    near = sorted({m for b in bad for m in difflib.get_close_matches(b, allowed, n=2)})
    return f"did you mean {near}?" if near else f"it has {sorted(allowed)}"


class EnvServer(BaseModel):
    """An environment server of the user's own, speaking dapo-env/1 (any language): the dataset's `env:NAME`
    parts it serves are run against it (mesh/envs.py)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://[^\s/]+", description="Its base URL: GET URL/v1/envs lists its environments.")
    token_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The environment variable holding its bearer token (the token itself is never in a preset).",
    )


class MeshConfig(BaseModel):
    """What `dapo-mesh up` starts. A wrong value (a typo in `transport`, a negative count, a key a section does not
    have) is an error that names the section, the field and the allowed values, at construction and assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_dir: Path = Field(Path(".dapo"), description="Redis AOF, models, logs, checkpoints, metrics.")
    steps: int = Field(20, ge=1, description="Learner batches to train.")
    tiny: bool = Field(False, description="A random tiny Llama instead of SmolLM2-135M-Instruct.")
    redis_url: str | None = Field(None, description="An external Redis; unset: the embedded one.")
    replicas: int = Field(1, ge=1, description="Rollout replicas.")
    engine: Literal["vllm", "hf"] = Field("vllm", description="The rollout engine.")
    n_samples: int = Field(8, ge=1, description="G: samples per prompt.")
    batch_size: int = Field(8, ge=1, description="B: groups per TrainBatch.")
    max_response_tokens: int = Field(128, ge=1, description="Tokens generated at most per sample.")
    minibatches: int = Field(4, ge=1, description="Optimizer steps per TrainBatch.")
    max_staleness: int = Field(
        1,
        ge=0,
        description="Versions a group may lag: the buffer batches nothing older, and the learner checks again at the "
        "update (its --stale-groups: drop, or reweight and count).",
    )
    lr: float = Field(1e-6, gt=0, description="Learning rate.")
    dataset: str = Field("reasoning_gym:chain_sum", description="The buffer's dataset spec.")
    transport: Literal["broadcast", "filesystem"] = Field(
        "broadcast", description="Weights to replicas: gloo/NCCL broadcast, or replicas reload the HF snapshots."
    )
    eval_every: int = Field(0, ge=0, description="Held-out avg@k by rollout-0 at version 0 and every n (0: off).")
    eval_size: int = Field(64, ge=1, description="Held-out prompts per evaluation.")
    eval_tasks: list[str] = Field(
        [],
        description="Evaluate only the held-out prompts of these tasks, e.g. reasoning_gym/basic_arithmetic (empty: "
        "all): of a mixture, the parts that can be learned, not those that only cost generation.",
    )
    eval_k: int = Field(4, ge=1, description="Samples per held-out prompt.")
    linger_s: float = Field(0.0, ge=0, description="Keep the mesh up this long after the last step.")
    max_restarts: int = Field(10, ge=0, description="Per service; 0: the first exit stops the mesh.")
    seed: int | None = Field(
        None,
        description="Seeds the rollouts' sampling, the learner's mini-batch shuffle and the buffer's dispatch order "
        "(unset: random sampling): the same seed repeats a run's samples for the same weights.",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Learner and replicas: bf16 where the hardware has it (auto), or fp32 everywhere."
    )
    placement: Literal["split", "shared"] = Field(
        "split",
        description="split: the learner pinned to the first half of the cores, the replicas' threads to the other "
        "half (measured: docs, Benchmarks); shared: every service on every core, the learner on 1 thread.",
    )
    learner_ranks: int = Field(
        1, ge=1, description="Data-parallel learner processes (torchrun, one machine): rank 0 serves, all train."
    )
    lora_rank: int | None = Field(
        None,
        ge=1,
        description="Train a LoRA adapter of this rank (the learner's --lora-rank; [learner] lora_alpha, lora_targets) "
        "and serve it on the replicas ([rollout] lora_serving: merged or vLLM's LoRA, replaced each version); unset: "
        "full fine-tuning.",
    )
    gateway_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve the OpenAI-compatible gateway: the router's port, the one endpoint agents use however "
        "many replicas serve it (each replica's own gateway gets a free port); unset: no gateway.",
    )
    env_servers: list[EnvServer] = Field(
        default_factory=list,
        description="Environment servers of your own by URL, each speaking dapo-env/1: the dataset's env:NAME parts "
        "they serve run against them (the mesh starts its own environment service only for the others). Checked "
        "before anything starts.",
    )
    trackers: list[Literal["wandb", "mlflow", "tensorboard"]] = Field(
        default_factory=list,
        description="Experiment trackers the run logs to ([tracking] sets them up; docs: operations/trackers.md): "
        "every metrics.jsonl row, the resolved config, a table of sampled episodes; an error at start-up if one "
        "cannot open, logged and skipped if one fails mid-run.",
    )
    tracking: TrackingSettings = Field(
        default_factory=TrackingSettings, description="The trackers' settings (project, run name, tables, URIs)."
    )
    reward: RewardSection = Field(default_factory=RewardSection, description="The reward server's settings.")
    env: EnvSection = Field(
        default_factory=EnvSection, description="The environment service's (started when the dataset has env: parts)."
    )
    buffer: BufferSection = Field(default_factory=BufferSection, description="The buffer's settings.")
    learner: LearnerSection = Field(default_factory=LearnerSection, description="The learner's settings.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Every rollout replica's settings.")
    router: RouterSection = Field(
        default_factory=RouterSection, description="The gateway's router's (started with gateway_port)."
    )
    sandbox: SandboxSection = Field(
        default_factory=SandboxSection,
        description="The sandbox service's (started when a file part of the dataset names the code verifier: @code).",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """A key no section has is named with the nearest ones (pydantic would only say 'extra inputs')."""
        if not isinstance(data, dict):
            return data
        if bad := sorted(set(data) - set(cls.model_fields)):
            raise ValueError(f"[mesh] has no setting {bad}; {_near(bad, set(cls.model_fields) - set(TABLES))}")
        for name in SERVICES:
            values = data.get(name)
            if not isinstance(values, dict):
                continue
            fields = set(SECTIONS[name].model_fields)
            if bad := sorted(set(values) - fields):
                raise ValueError(f"[{name}] has no setting {bad}; {_near(bad, fields)}")
            if owned := sorted(set(values) & (MESH_SETS[name] | SECRETS[name])):
                raise ValueError(f"[{name}] sets {owned}, which the mesh sets: {_owned(name, owned)}")
        return data

    @model_validator(mode="after")
    def _dataset_checks(self) -> Self:
        """The dataset spec's syntax, weights, task names, files and named verifiers, before anything starts (the
        buffer reads the data itself when it starts: a file row without a verifier, an empty held-out share)."""
        from reward_server.verifiers import check_name
        from services.datasets import check_spec, data_sources

        try:
            verifiers = check_spec(self.dataset)
        except (ValueError, OSError) as e:
            raise ValueError(f"dataset {self.dataset!r}: {e}") from None
        for v in verifiers:
            if v != CLIENT_SCORED and (problem := check_name(v)):
                raise ValueError(f"dataset {self.dataset!r}: {problem}")
        known = data_sources(self.dataset)
        if known is not None and (unknown := sorted(set(self.eval_tasks) - known)):
            raise ValueError(f"eval_tasks {unknown}: the dataset's tasks are {sorted(known)}")
        return self

    @model_validator(mode="after")
    def _ranks_have_samples(self) -> Self:
        per_minibatch = max(1, self.batch_size * self.n_samples // self.minibatches)
        if self.learner_ranks > per_minibatch:
            raise ValueError(
                f"learner_ranks {self.learner_ranks} > {per_minibatch} samples per mini-batch (batch_size "
                f"{self.batch_size} x n_samples {self.n_samples} / minibatches {self.minibatches}): every rank needs "
                "samples of each mini-batch"
            )
        return self

    @model_validator(mode="after")
    def _budget_fits_the_group(self) -> Self:
        """The buffer's sampling budget against the mesh's n_samples (the section alone sees its default)."""
        b = self.buffer
        if b.sampling_rule == "fixed":
            return self
        first, most = b.sampling_first or max(1, self.n_samples // 2), b.sampling_most or 2 * self.n_samples
        if first > most or self.n_samples > most:
            raise ValueError(
                f"buffer.sampling_most {most} must be at least n_samples ({self.n_samples}) and sampling_first "
                f"({first})"
            )
        return self

    @model_validator(mode="after")
    def _lora_is_served(self) -> Self:
        if self.lora_rank is not None and self.engine != "vllm":
            raise ValueError('lora_rank: the replicas serve adapters with vLLM\'s LoRA; set engine = "vllm"')
        return self

    @model_validator(mode="after")
    def _gateway_is_served(self) -> Self:
        if self.gateway_port is not None and (self.engine != "vllm" or not self.rollout.stream):
            raise ValueError('gateway_port: the gateway is served by vLLM\'s continuous batching: engine = "vllm"')
        if self.gateway_port is None and self.rollout.gateway_only:
            raise ValueError("[rollout] gateway_only: the replicas serve no gateway: set [mesh] gateway_port")
        return self

    def section(self, service: Service) -> dict[str, Any]:
        """What the preset set for `service` (nothing the service would default or read from its environment)."""
        values: BaseModel = getattr(self, service)
        return values.model_dump(include=values.model_fields_set)

    @classmethod
    def from_preset(cls, path: Path, **overrides: Any) -> MeshConfig:
        """A preset file, with `overrides` of the [mesh] section (the caller's: run_dir, redis_url, ...)."""
        return cls.validated(load_preset(path).data | overrides, where=str(path))

    @classmethod
    def validated(cls, data: dict[str, Any], where: str = "the mesh config") -> MeshConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PresetError(f"{where}: {describe(e)}" if where else describe(e)) from None

    @classmethod
    def tiny_preset(
        cls, run_dir: Path, steps: int = 3, sections: dict[str, dict[str, Any]] | None = None
    ) -> MeshConfig:
        """The tiny mesh (a random Llama, the HF engine, small groups): a smoke test in a minute (`tiny_data`)."""
        return cls.validated(tiny_data(run_dir, steps, sections), where="--tiny")


def tiny_data(run_dir: Path, steps: int = 3, sections: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The tiny mesh's config, not yet validated (`dapo-mesh up --tiny` adds its options first). `sections`: a
    preset's service sections to run at this scale; `TINY_NEEDS` is applied over them."""
    sections = {name: dict(values) for name, values in (sections or {}).items()}
    for (name, key), value in TINY_NEEDS.items():
        sections.setdefault(name, {})[key] = value
    scale = {"n_samples": 4, "batch_size": 4, "max_response_tokens": 24, "minibatches": 2, "lr": 1e-4}
    evaluation = {"eval_size": 16, "eval_k": 2}
    return {"run_dir": run_dir, "steps": steps, "tiny": True, "engine": "hf", **scale, **evaluation, **sections}


# What the tiny mesh needs whatever the preset says: a random model gets nothing right, so dynamic sampling would
# keep nothing; the presets' off-policy correction for a group past the bound at the update.
TINY_NEEDS: dict[tuple[Service, str], Any] = {
    ("buffer", "dynamic_sampling"): False,
    ("buffer", "sampling_rule"): "fixed",  # rounds need dynamic sampling (a given-up group would be trained)
    ("buffer", "dispatch_policy"): "uniform",  # the curriculum predicts the filter that is off here
    ("learner", "off_policy"): "token-tis",
    ("learner", "stale_groups"): "reweight",
}

# where a run goes and what runs it are the caller's, not a preset's
PRESET_MESH_FIELDS = set(MeshConfig.model_fields) - {"run_dir", "redis_url", "tracking", *SERVICES}
TABLES = ("tracking", *SERVICES)  # a preset's [sections] beside [mesh]


class PresetError(ValueError):
    pass


def describe(e: ValidationError) -> str:
    """`[section] field: what is wrong` for each error, e.g. "[mesh] transport: Input should be 'broadcast' or
    'filesystem'", "[learner] clip_high: Input should be greater than 0"."""
    out = []
    for x in e.errors():
        loc = [str(p) for p in x["loc"]]
        section, field = (loc[0], loc[1:]) if loc and loc[0] in TABLES else ("mesh", loc)
        msg = x["msg"].removeprefix("Value error, ")
        out.append(msg if msg.startswith("[") else f"[{section}] {'.'.join(field)}: {msg}".replace(" : ", ": "))
    return "; ".join(out)


@dataclasses.dataclass
class Preset:
    path: Path
    data: dict[str, Any]  # the [mesh] keys at the top, one dict per service section

    @property
    def mesh(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k not in TABLES}

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.data.items() if k in SERVICES}


def to_flags(values: dict[str, Any]) -> list[str]:
    """Settings as a service's command line: `--clip-high 0.28`, `--no-dynamic-sampling`; None is left out."""
    out: list[str] = []
    for key, v in values.items():
        flag = "--" + key.replace("_", "-")
        if v is None:
            continue
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + key.replace("_", "-"))
        elif isinstance(v, SecretStr):
            raise ValueError(f"{key} is a secret: it travels in the environment, never on a command line")
        else:
            out += [flag, json.dumps(v) if isinstance(v, dict | list) else str(v)]
    return out


def read_preset(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, dict[str, Any]]:
    """The file's sections merged over those of its `base` chain. `base` is a file name, or a list of them merged in
    order (a later one's keys win): `base = ["../ablations/3-clip-higher.toml", "task.toml"]` is a row of an ablation
    on another task."""
    path = path.resolve()
    if path in _seen:
        raise PresetError(f"{path}: its base chain loops back to it")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PresetError(f"{path}: {e}") from e
    base = data.pop("base", None)
    if base is None:
        return data
    bases = [base] if isinstance(base, str) else base
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) for b in bases):
        raise PresetError(f"{path}: base must be a file name or a list of them, got {base!r}")
    merged: dict[str, dict[str, Any]] = {}
    for name in bases:
        _merge_sections(merged, read_preset(path.parent / name, (*_seen, path)))
    for section, values in data.items():
        if not isinstance(values, dict):
            raise PresetError(f"{path}: {section!r} is not a [section]")
    _merge_sections(merged, data)
    return merged


def _merge_sections(into: dict[str, Any], more: dict[str, Any]) -> None:
    """`more`'s sections over `into`'s, key by key (a stray non-table key replaces: load_preset names it)."""
    for section, values in more.items():
        prev = into.get(section)
        into[section] = prev | values if isinstance(prev, dict) and isinstance(values, dict) else values


def load_preset(path: Path) -> Preset:
    """A preset file, read and validated as a whole (MeshConfig): every error names its section and field."""
    data = read_preset(path)
    if bad := sorted(k for k, v in data.items() if not isinstance(v, dict)):
        raise PresetError(f"{path}: {bad} outside a [section]")
    if unknown := sorted(set(data) - {"mesh", *TABLES}):
        raise PresetError(f"{path}: unknown sections {unknown}; use [mesh], [{'], ['.join(TABLES)}]")
    mesh = dict(data.get("mesh", {}))
    if callers := sorted(set(mesh) & (set(MeshConfig.model_fields) - PRESET_MESH_FIELDS)):
        raise PresetError(f"{path}: [mesh] {callers} belong to the command line, not a preset")
    flat = mesh | {name: dict(data.get(name, {})) for name in TABLES}
    MeshConfig.validated(flat, where=str(path))
    return Preset(path, flat)
