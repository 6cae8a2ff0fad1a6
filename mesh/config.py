"""The mesh's configuration: `MeshConfig` (scale, model, transport, evaluation) and the preset files that fill
it together with each service's settings.

    cfg = MeshConfig.from_preset(Path("configs/dapo.toml"), run_dir=Path(".dapo"))
    cfg = MeshConfig.tiny_preset(Path(".dapo"), steps=3)      # a random tiny Llama: a smoke test

A preset is one TOML file:

    [mesh]                 # MeshConfig fields: steps, n_samples, batch_size, lr, ...
    [learner]              # LearnerSettings fields: clip_high, loss_agg, overlong_filter, ...
    [buffer]               # BufferSettings fields: dynamic_sampling, ...
    [reward]               # RewardSettings fields: overlong_shaping, ...
    [rollout]              # RolloutSettings fields: temperature, ...

A preset may start from another (`base = "../grpo.toml"`, relative to the file) and change a few keys:
configs/ablations/ climbs DAPO's Table 1 that way, one technique per file. Every key is checked against
the model of its section and every value validated by it, so a typo fails before anything starts.
Service sections become flags (`--clip-high 0.2`, `--no-dynamic-sampling`) after the mesh's own, so they
win (mesh/commands.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.child_process import ROOT

DEFAULT_PRESET = ROOT / "configs" / "dapo.toml"  # what `dapo-mesh up` runs without --config
Service = Literal["reward", "buffer", "learner", "rollout"]


class MeshConfig(BaseModel):
    """What `dapo-mesh up` starts. A wrong value (a typo in `transport`, a negative count) is an error that names
    the field and the allowed values, at construction and at assignment."""

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
        "half (measured: README, Benchmarks); shared: every service on every core, the learner on 1 thread.",
    )
    learner_ranks: int = Field(
        1, ge=1, description="Data-parallel learner processes (torchrun, one machine): rank 0 serves, all train."
    )
    extra: dict[Service, list[str]] = Field(default_factory=dict, description="More flags per service.")

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

    @classmethod
    def from_preset(cls, path: Path, **overrides: Any) -> MeshConfig:
        """A preset file: its [mesh] section, and its service sections as extra flags."""
        preset = load_preset(path)
        extra = {name: preset.flags(name) for name in preset.services if preset.services[name]}
        return cls.model_validate(preset.mesh | overrides | {"extra": extra})

    @classmethod
    def tiny_preset(cls, run_dir: Path, steps: int = 3) -> MeshConfig:
        return cls(
            run_dir=run_dir,
            steps=steps,
            tiny=True,
            engine="hf",
            n_samples=4,
            batch_size=4,
            max_response_tokens=24,
            minibatches=2,
            lr=1e-4,
            eval_size=16,
            eval_k=2,
            extra={
                "buffer": ["--no-dynamic-sampling"],  # a random model gets nothing right
                # as the presets: a group past the bound at the update is trained under the correction
                "learner": ["--off-policy", "token-tis", "--stale-groups", "reweight"],
            },
        )


# where a run goes and what runs it are the caller's, not a preset's
PRESET_MESH_FIELDS = set(MeshConfig.model_fields) - {"run_dir", "extra", "redis_url"}


def _service_settings() -> dict[str, Any]:
    from buffer.settings import BufferSettings
    from learner.settings import LearnerSettings
    from reward_server.settings import RewardSettings
    from rollout.settings import RolloutSettings

    return {"learner": LearnerSettings, "buffer": BufferSettings, "reward": RewardSettings, "rollout": RolloutSettings}


class PresetError(ValueError):
    pass


def describe(e: ValidationError) -> str:
    """`field: what is wrong` for each error, e.g. "transport: Input should be 'broadcast' or 'filesystem'"."""
    return "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())


@dataclasses.dataclass
class Preset:
    path: Path
    mesh: dict[str, Any]
    services: dict[str, dict[str, Any]]

    def flags(self, service: str) -> list[str]:
        return to_flags(self.services.get(service, {}))


def to_flags(values: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, v in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, json.dumps(v) if isinstance(v, dict | list) else str(v)]
    return out


def read_preset(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, dict[str, Any]]:
    """The file's sections merged over those of its `base` chain."""
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
    if not isinstance(base, str):
        raise PresetError(f"{path}: base must be a file name, got {base!r}")
    merged = read_preset(path.parent / base, (*_seen, path))
    for section, values in data.items():
        if not isinstance(values, dict):
            raise PresetError(f"{path}: {section!r} is not a [section]")
        merged[section] = merged.get(section, {}) | values
    return merged


def _validate(path: Path, section: str, model: type[BaseModel], values: dict[str, Any], allowed: set[str]) -> None:
    if bad := sorted(set(values) - allowed):
        near = sorted({m for b in bad for m in difflib.get_close_matches(b, allowed, n=2)})
        raise PresetError(
            f"{path}: [{section}] has no setting {bad}; "
            + (f"did you mean {near}?" if near else f"it has {sorted(allowed)}")
        )
    try:
        model.model_validate(values)
    except ValidationError as e:
        raise PresetError(f"{path}: [{section}] {describe(e)}") from None


def load_preset(path: Path) -> Preset:
    data = read_preset(path)
    classes = _service_settings()
    if bad := sorted(k for k, v in data.items() if not isinstance(v, dict)):
        raise PresetError(f"{path}: {bad} outside a [section]")
    unknown = sorted(set(data) - {"mesh", *classes})
    if unknown:
        raise PresetError(f"{path}: unknown sections {unknown}; use [mesh], [{'], ['.join(classes)}]")
    mesh = dict(data.get("mesh", {}))
    _validate(path, "mesh", MeshConfig, mesh, PRESET_MESH_FIELDS)
    services: dict[str, dict[str, Any]] = {}
    for name, cls in classes.items():
        services[name] = dict(data.get(name, {}))
        _validate(path, name, cls, services[name], set(cls.model_fields))
    return Preset(path, mesh, services)
