"""Run presets: one TOML file sets the mesh's scale and each service's settings.

    dapo-mesh up --config configs/dapo.toml          # every DAPO technique on
    dapo-mesh up --config configs/grpo.toml          # naive GRPO: each of them off

    [mesh]                 # MeshConfig fields (services/mesh.py): steps, n_samples, batch_size, lr, ...
    [learner]              # LearnerSettings fields: clip_high, loss_agg, overlong_filter, ...
    [buffer]               # BufferSettings fields: dynamic_sampling, ...
    [reward]               # RewardSettings fields: overlong_shaping, ...
    [rollout]              # RolloutSettings fields: temperature, ...

A preset may start from another (`base = "../grpo.toml"`, relative to the file) and change a few keys:
configs/ablations/ climbs DAPO's Table 1 that way, one technique per file. Every key is checked against
the settings class of its section and every value validated by it, so a typo fails before anything starts.
Service sections become flags (`--clip-high 0.2`, `--no-dynamic-sampling`) after the mesh's own, so they
win.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError


def _service_settings() -> dict[str, Any]:
    from learner.settings import LearnerSettings
    from reward_server.settings import RewardSettings
    from rollout.settings import RolloutSettings
    from services.buffer.settings import BufferSettings

    return {"learner": LearnerSettings, "buffer": BufferSettings, "reward": RewardSettings, "rollout": RolloutSettings}


class PresetError(ValueError):
    pass


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


def load_preset(path: Path, mesh_fields: set[str]) -> Preset:
    data = read_preset(path)
    classes = _service_settings()
    if bad := sorted(k for k, v in data.items() if not isinstance(v, dict)):
        raise PresetError(f"{path}: {bad} outside a [section]")
    unknown = sorted(set(data) - {"mesh", *classes})
    if unknown:
        raise PresetError(f"{path}: unknown sections {unknown}; use [mesh], [{'], ['.join(classes)}]")
    mesh = dict(data.get("mesh", {}))
    if bad := sorted(set(mesh) - mesh_fields):
        raise PresetError(f"{path}: [mesh] has no setting {bad}; it has {sorted(mesh_fields)}")
    services: dict[str, dict[str, Any]] = {}
    for name, cls in classes.items():
        values = dict(data.get(name, {}))
        if bad := sorted(set(values) - set(cls.model_fields)):
            raise PresetError(f"{path}: [{name}] has no setting {bad}")
        try:
            cls.model_validate(values)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise PresetError(f"{path}: [{name}] {msgs}") from None
        services[name] = values
    return Preset(path, mesh, services)
