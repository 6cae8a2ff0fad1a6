"""The learner's other modes, on the real DeepSpeed trainer and a tiny random Llama (the review's fixes, issue 27):
what Dr.GRPO and GRPO divide by, the temperature on the full-logits path, where the cosine ends, the optimizer
steps a version counts, and a model whose logits are transformed after the head."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from learner.batching import to_tensors
from learner.checkpoint import LearnerState
from learner.loss import token_logprobs
from learner.metrics import LearnerMetrics
from learner.service import Learner
from learner.settings import LearnerSettings
from learner.tiny import group
from learner.trainer import Trainer
from services.redis_server import EmbeddedRedis
from services.schemas import ScoredGroup, TrainBatch
from services.streams import STREAM_BATCHES, StreamProducer, connect

pytestmark = pytest.mark.slow
MIXED, SAME = [1.0, -1.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0]  # SAME: advantage 0 for every sample, no gradient


def trainer(tmp_path: Path, model: Path, **kw: Any) -> Trainer:
    defaults: dict[str, Any] = {"lr": 1e-3, "warmup_batches": 0, "minibatches": 1, "dtype": "fp32", "hf_export": False}
    s = LearnerSettings(model_dir=model, run_dir=tmp_path / uuid.uuid4().hex[:8], **(defaults | kw))
    return Trainer(s)


def batch(*groups: ScoredGroup) -> TrainBatch:
    return TrainBatch.assemble(0, list(groups))


def with_samples(g: ScoredGroup, **update: Any) -> ScoredGroup:
    return g.model_copy(update={"samples": [s.model_copy(update=update) for s in g.samples]})


def test_dr_grpo_divides_by_a_constant_not_the_longest_prompt(tiny_model: Path, tmp_path: Path) -> None:
    """Two batches of the same size whose second group (advantage 0: no gradient of its own) has a 6- or a
    40-token prompt: the first group's gradient is the same. It was not while the divisor was the padded width."""
    dr = {"loss_agg": "seq-mean-token-sum-norm", "max_response_tokens": 16, "normalize_std": False}
    short = batch(group(1, MIXED), group(2, SAME, prompt_len=6))
    long = batch(group(1, MIXED), group(2, SAME, prompt_len=40))
    a = trainer(tmp_path, tiny_model, **dr).train(short)["grad_norm"]
    b = trainer(tmp_path, tiny_model, **dr).train(long)["grad_norm"]
    assert a > 0 and b == pytest.approx(a, rel=1e-4)
    with pytest.raises(ValueError, match="set max_response_tokens"):
        LearnerSettings(loss_agg="seq-mean-token-sum-norm")  # no silent fallback to a batch-dependent divisor


def test_grpo_seq_mean_counts_only_samples_with_a_loss_token(tiny_model: Path, tmp_path: Path) -> None:
    """A group whose samples were all truncated leaves the loss under the overlong filter: the batch's other
    samples train as if it were not there (it was counted in the divisor, diluting their gradient by half)."""
    grpo = {"loss_agg": "seq-mean-token-mean", "overlong_filter": True}
    truncated = with_samples(group(3, MIXED), finish_reason="length")
    alone = trainer(tmp_path, tiny_model, **grpo).train(batch(group(1, MIXED)))
    beside = trainer(tmp_path, tiny_model, **grpo).train(batch(group(1, MIXED), truncated))
    assert alone["grad_norm"] > 0 and beside["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
    assert alone["truncated_frac"] == 0.0 and beside["truncated_frac"] == 0.5  # what the filter masked, recorded
    assert (alone["batch_samples"], beside["batch_samples"]) == (4.0, 8.0)


def test_the_full_logits_path_divides_by_the_temperature_in_fp32(tiny_model: Path, tmp_path: Path) -> None:
    """ZeRO-3 takes the model's full forward; ZeRO-0 the chunked lm_head. At T = 0.7 in bf16 both give the same
    log-probs within bf16's matmul rounding (the full path divided bf16 logits by a bf16 0.7 = 0.6992 before)."""
    b = batch(with_samples(group(1, MIXED), temperature=0.7), with_samples(group(2, MIXED), temperature=0.7))
    out = []
    for stage in (0, 3):
        t = trainer(tmp_path, tiny_model, dtype="bf16", zero_stage=stage)
        if t.dtype != "bf16":
            pytest.skip("this CPU has no bf16 kernels (AMX or AVX512-BF16)")
        tensors = to_tensors(b, t.pad_id)
        out.append((t.logprobs(tensors)[0], tensors.response_mask.bool()))
    (chunked, mask), (full, _) = out
    assert torch.allclose(full[mask], chunked[mask], atol=1e-4), (full[mask] - chunked[mask]).abs().max()


def test_the_cosine_ends_where_get_cosine_schedule_with_warmup_does(tiny_model: Path, tmp_path: Path) -> None:
    """With lr_decay_batches unset the cosine decays over max_batches - warmup_batches, as transformers' schedule
    over the same batches: the last batch's rate is the curve's last step, not a point a warm-up short of it."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    n, warmup, lr, floor = 10, 3, 1e-3, 0.1
    t = trainer(tmp_path, tiny_model, lr=lr, lr_schedule="cosine", max_batches=n, warmup_batches=warmup,
                lr_min_ratio=floor)  # fmt: skip
    ours = [t.set_lr(k) for k in range(n)]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    hf = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, n, min_lr_rate=floor).lr_lambdas[0]
    theirs = [lr * hf(k) for k in range(n)]
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-9)  # after the warm-up (ours starts at 1/w, not 0)
    assert ours[-1] == pytest.approx(
        lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (n - 1 - warmup) / (n - warmup))))
    )


def test_a_version_counts_the_optimizer_steps_taken(tiny_model: Path, tmp_path: Path) -> None:
    """A batch of 4 samples with minibatches 8 makes 4 optimizer steps (one per sample), and the learner's state
    (published as WeightVersion.step) adds 4, not the 8 configured."""
    t = trainer(tmp_path, tiny_model, minibatches=8)
    t.s.run_dir.mkdir(parents=True)
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        StreamProducer(client, STREAM_BATCHES).publish(batch(group(1, MIXED)))
        learner = Learner(t.s, client, t, LearnerState(), LearnerMetrics(CollectorRegistry()))
        learner.step()
        assert learner.state.version == 1 and learner.state.step == 4
        client.close()


def test_a_model_that_softcaps_its_logits_gets_them_softcapped(tmp_path: Path) -> None:
    """Gemma 2 soft-caps its logits after the head (tanh(z / c) * c): the trainer's log-probs are those of the
    model's own forward (as vLLM's), not of the head alone, which the chunked path used to take."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    model_dir = tmp_path / "gemma2"
    Gemma2ForCausalLM(config).save_pretrained(model_dir)
    t = trainer(tmp_path, model_dir, attention="eager")
    b = batch(with_samples(group(1, MIXED), temperature=0.7))
    tensors = to_tensors(b, t.pad_id)
    ours = t.logprobs(tensors)[0]
    with torch.no_grad():
        logits = t.engine.module(input_ids=tensors.input_ids, attention_mask=tensors.attention_mask).logits
    reference = token_logprobs(logits.float() / 0.7, tensors.input_ids)
    mask = tensors.response_mask.bool()
    assert torch.allclose(ours[mask], reference[mask], atol=1e-5)
    head_only = torch.nn.functional.linear(
        t.engine.module.get_decoder()(input_ids=tensors.input_ids, attention_mask=tensors.attention_mask)[0],
        t.engine.module.get_output_embeddings().weight,
    )
    assert not torch.allclose(token_logprobs(head_only / 0.7, tensors.input_ids)[mask], reference[mask], atol=1e-3)
    assert t.full_logits  # and so it took the full forward
