"""LoRA adapters on the wire and on disk (services/adapters.py): the base model's fingerprint, what a replica checks
before it allocates anything, the manifest that carries an adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.adapters import AdapterInfo, check_adapter, fingerprint, module_of
from services.weight_wire import BadRound, Manifest, check_manifest, model_specs

P = "base_model.model.model.layers.0.self_attn."


def _model(path: Path, seed: int, rows: int = 8) -> Path:
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(rows, 6, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 6, generator=g),
        "model.norm.weight": torch.ones(6),
    }
    save_file(weights, path / "model.safetensors")
    return path


def _adapter(r: int, modules: tuple[str, ...] = ("q_proj", "v_proj")) -> list[tuple[str, tuple[int, ...]]]:
    out = {"q_proj": (8, 6), "v_proj": (4, 6)}
    params = []
    for m in modules:
        params += [(f"{P}{m}.lora_A.weight", (r, out[m][1])), (f"{P}{m}.lora_B.weight", (out[m][0], r))]
    return params


def test_the_fingerprint_tells_base_models_apart(tmp_path: Path) -> None:
    a = fingerprint(_model(tmp_path / "a", seed=0))
    assert a == fingerprint(_model(tmp_path / "a-again", seed=0))  # the same weights, another folder
    assert a != fingerprint(_model(tmp_path / "b", seed=1))  # same architecture, other weights
    assert a != fingerprint(_model(tmp_path / "c", seed=0, rows=9))  # another shape
    with pytest.raises(FileNotFoundError):
        fingerprint(tmp_path / "none")


def test_an_adapter_must_fit_the_base_model_and_the_server(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=0)
    base, specs = fingerprint(model), model_specs(model)
    info = AdapterInfo(base, 4, 8.0, ("q_proj", "v_proj"))
    check_adapter(info, _adapter(4), specs, base, max_rank=4)
    check_adapter(AdapterInfo(base, 4, 8.0, ("self_attn.q_proj",)), _adapter(4, ("q_proj",)), specs, base, max_rank=8)
    cases = [
        ("does not cover its targets", info, _adapter(4, ("q_proj",)), 8),  # v_proj would run the base weights
        ("does not cover its targets", AdapterInfo(base, 4, 8.0, ("q_proj",)), _adapter(4), 8),
        ("alpha nan", AdapterInfo(base, 4, float("nan"), ("q_proj", "v_proj")), _adapter(4), 8),
        ("another base model", AdapterInfo("0" * 16, 4, 8.0, ()), _adapter(4), 8),
        ("rank 4 is not in 1..2", info, _adapter(4), 2),
        ("no 2-d weight model.norm", info, [("base_model.model.model.norm.lora_A.weight", (4, 6))], 8),
        (r"shape \(3, 6\)", info, [(f"{P}q_proj.lora_A.weight", (3, 6)), (f"{P}q_proj.lora_B.weight", (8, 4))], 8),
        ("lora_A or lora_B alone", info, _adapter(4)[:1], 8),
        ("not a LoRA tensor", info, [("model.layers.0.self_attn.q_proj.weight", (8, 6))], 8),
        ("no LoRA tensor", info, [], 8),
    ]
    for match, inf, params, rank in cases:
        with pytest.raises(ValueError, match=match):
            check_adapter(inf, params, specs, base, max_rank=rank)


def test_a_manifest_carries_the_adapter_and_replicas_refuse_the_wrong_kind(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=0)
    base, specs = fingerprint(model), model_specs(model)
    info = AdapterInfo(base, 4, 8.0, ("q_proj", "v_proj"))
    lora = Manifest.plan([(n, torch.bfloat16, s) for n, s in _adapter(4)], 1 << 20, adapter=info)
    assert Manifest.from_bytes(lora.to_bytes()) == lora and lora.adapter == info
    check_manifest(lora, specs, base=base, max_rank=8)
    full = Manifest.plan([(n, torch.float32, s) for n, s in specs.items()], 1 << 20)
    assert Manifest.from_bytes(full.to_bytes()).adapter is None
    with pytest.raises(BadRound, match="this replica serves full weights"):
        check_manifest(lora, specs)
    with pytest.raises(BadRound, match="the learner sends full weights"):
        check_manifest(full, specs, base=base, max_rank=8)
    other = fingerprint(_model(tmp_path / "other", seed=5))
    with pytest.raises(BadRound, match="another base model"):
        check_manifest(lora, specs, base=other, max_rank=8)


def test_module_names_of_lora_tensors() -> None:
    assert module_of(f"{P}q_proj.lora_B.weight") == ("model.layers.0.self_attn.q_proj", "B")
    with pytest.raises(ValueError):
        module_of(f"{P}q_proj.lora_A.default.weight")  # the in-memory name, not the saved one
