"""LoRA on the learner (issue 31), on the real DeepSpeed trainer and a tiny random Llama: only the adapter trains
and is checkpointed, a resume continues as if uninterrupted, the export is PEFT's adapter folder and `merge` gives
the same model, the weight sync sends the adapter alone, and bad settings fail before anything starts."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from learner import checkpoint
from learner.checkpoint import LearnerState
from learner.settings import LearnerSettings
from learner.tiny import tiny_batch
from learner.trainer import Trainer
from learner.weight_sync import WeightSender
from services.adapters import ADAPTER_CONFIG, ADAPTER_INFO, ADAPTER_WEIGHTS, fingerprint, merge, read_adapter
from services.redis_server import EmbeddedRedis
from services.streams import connect

pytestmark = pytest.mark.slow


def trainer(tmp_path: Path, model: Path, **kw: Any) -> Trainer:
    defaults: dict[str, Any] = {
        "lr": 1e-2,
        "warmup_batches": 0,
        "minibatches": 2,
        "dtype": "fp32",
        "hf_export": False,
        "lora_rank": 4,
        "sync_port": 0,
    }
    s = LearnerSettings(model_dir=model, **({"run_dir": tmp_path / uuid.uuid4().hex[:8]} | defaults | kw))
    return Trainer(s)


def _state(t: Trainer, trainable: bool) -> dict[str, torch.Tensor]:
    """The values (ZeRO-3: gathered) of the trainable parameters, or of the frozen ones."""
    import deepspeed

    named = [(n, p) for n, p in t.engine.module.named_parameters() if p.requires_grad == trainable]
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=t.s.zero_stage == 3):
        return {n: p.detach().clone() for n, p in named}


def adapter_state(t: Trainer) -> dict[str, torch.Tensor]:
    return _state(t, True)


def base_state(t: Trainer) -> dict[str, torch.Tensor]:
    return _state(t, False)


@pytest.mark.parametrize(("dtype", "stage"), [("fp32", 0), ("bf16", 0), ("fp32", 3)])
def test_only_the_adapter_trains(tiny_model: Path, tmp_path: Path, dtype: str, stage: int) -> None:
    t = trainer(tmp_path, tiny_model, dtype=dtype, zero_stage=stage)
    trainable = adapter_state(t)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(float(p.abs().sum()) == 0 for n, p in trainable.items() if ".lora_B." in n)  # version 0 = the base
    base = base_state(t)
    batch = tiny_batch(0)
    before = t.sequence_logprob(batch)
    t.train(batch, version=0)
    after_base = base_state(t)
    assert all(torch.equal(base[n], after_base[n]) for n in base), "a frozen base weight moved"
    moved = adapter_state(t)
    assert any(not torch.equal(trainable[n], moved[n]) for n in trainable if ".lora_B." in n)
    # the update goes where the advantages say: samples with reward +1 (even positions) gain, -1 lose
    delta = t.sequence_logprob(batch) - before
    rewards = torch.tensor([sc.reward for g in batch.groups for sc in g.scores])
    assert float(delta[rewards > 0].mean()) > float(delta[rewards < 0].mean())


@pytest.mark.parametrize("stage", [0, 3])
def test_the_checkpoint_holds_the_adapter_and_a_resume_continues_it(
    tiny_model: Path, tmp_path: Path, stage: int
) -> None:
    run_dir = tmp_path / "run"
    first = trainer(tmp_path, tiny_model, run_dir=run_dir, zero_stage=stage)
    first.train(tiny_batch(0), version=0)
    state = LearnerState()
    state.advance(0, 2, "d0")
    checkpoint.save(first.engine, run_dir, state)
    saved = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    base_bytes = sum(p.numel() * 4 for p in base_state(first).values())
    assert saved < base_bytes, f"the checkpoint ({saved} B) holds more than the adapter ({base_bytes} B of base)"
    first.train(tiny_batch(1), version=1)
    uninterrupted = adapter_state(first)

    second = trainer(tmp_path, tiny_model, run_dir=run_dir, zero_stage=stage)
    resumed = checkpoint.load(second.engine, run_dir)
    assert resumed is not None and resumed.version == 1 and resumed.trained == [0]
    second.train(tiny_batch(1), version=1)  # the optimizer's moments came back too: the same step as before
    got = adapter_state(second)
    for n, want in uninterrupted.items():
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6, msg=n)
    other = trainer(tmp_path, tiny_model, run_dir=run_dir, lora_rank=8, zero_stage=stage)  # not the run's adapter
    with pytest.raises(RuntimeError, match="resume with the run's --lora-rank"):
        checkpoint.load(other.engine, run_dir)


def test_the_export_is_a_peft_adapter_and_merge_gives_the_same_model(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    t = trainer(tmp_path, tiny_model)
    t.train(tiny_batch(0), version=0)
    folder = checkpoint.export_hf(t.engine, tmp_path / "hf", 1, adapter=t.adapter)
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_INFO} <= {f.name for f in folder.iterdir()}
    assert not list(folder.glob("model*.safetensors"))  # the base is not copied into every snapshot
    info, tensors = read_adapter(folder)
    assert info.base == fingerprint(tiny_model) and info.rank == 4 and info.alpha == 8.0
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in tensors)

    merged = AutoModelForCausalLM.from_pretrained(merge(tiny_model, folder, tmp_path / "merged"), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 200, 41]])
    with torch.no_grad():
        want = t.engine.module(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits, got, atol=1e-4), (
        "the adapter changed nothing: the test would not see a wrong merge"
    )


def test_the_weight_sync_sends_the_adapter_alone(tiny_model: Path, tmp_path: Path, server: EmbeddedRedis) -> None:
    t = trainer(tmp_path, tiny_model)
    sender = WeightSender(t.s, connect(server.url), t.engine.module, CollectorRegistry())
    try:
        m = sender.manifest
        folder = checkpoint.export_hf(t.engine, tmp_path / "hf", 0, adapter=t.adapter)
        saved = load_file(str(folder / ADAPTER_WEIGHTS))
        assert {n for n, _, _ in m.params} == set(saved)  # the names and tensors of PEFT's file, nothing else
        assert all(tuple(saved[n].shape) == s for n, _, s in m.params)
        assert m.adapter == t.adapter
        params = list(t.engine.module.parameters())  # what a ZeRO-3 follower gathers, by position (learner/ranks.py)
        assert all(params[sender.positions[i]] is p for i, (_, p) in enumerate(sender.params))
        full = sum(p.numel() * p.element_size() for p in t.engine.module.parameters())
        assert m.nbytes < full / 2
    finally:
        sender.close()


def test_bad_lora_settings_fail_before_anything_starts(tiny_model: Path, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from mesh.config import MeshConfig, PresetError

    with pytest.raises(ValidationError, match="lora_rank"):
        LearnerSettings(lora_rank=0)
    with pytest.raises(ValidationError, match="lora_targets"):
        LearnerSettings(lora_targets="q_proj,,v_proj")
    with pytest.raises(ValueError, match="no such linear layer; it has .*q_proj"):
        trainer(tmp_path, tiny_model, lora_targets="q_proj,qkv_proj")
    with pytest.raises(PresetError, match="engine"):
        MeshConfig.validated({"lora_rank": 8, "engine": "hf"})
