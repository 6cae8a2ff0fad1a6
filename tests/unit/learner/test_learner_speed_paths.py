"""The learner's fast paths change no number: chunked log-probs, token-budget micro-batches, dtype choice, placement."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from learner.batching import microbatches, token_microbatches
from learner.logprobs import chunked_logprobs
from learner.loss import token_logprobs_and_entropy
from services.dtype import cpu_flags, machine, resolve_dtype
from services.placement import parse_cores, place


@pytest.mark.parametrize(("chunk", "bias"), [(1, False), (5, False), (7, True), (10_000, False)])
def test_chunked_logprobs_equal_the_full_logits_ones(chunk: int, bias: bool) -> None:
    """Values, entropies and gradients (hidden states, lm_head weight and bias) within 1e-6 of the unchunked
    computation on the full [B, T, V] logits, at per-row temperatures, with chunks that split rows."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 17, 16, 50
    head = torch.nn.Linear(h, v, bias=bias)  # torch's own init: logits of std ~1, as a trained LM's are near
    hidden = torch.randn(b, t, h, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (b, t), generator=g)
    temp = torch.tensor([1.0, 0.7, 1.3])
    upstream = torch.randn(b, t, generator=g)  # any loss that is a function of the log-probs

    lp, ent = chunked_logprobs(hidden, head, ids, temp, chunk=chunk, with_entropy=True)
    (lp * upstream).sum().backward()
    grads = [hidden.grad.clone(), *(p.grad.clone() for p in head.parameters())]  # type: ignore[union-attr]
    hidden.grad = None
    head.zero_grad(set_to_none=True)

    ref_lp, ref_ent = token_logprobs_and_entropy(head(hidden) / temp.view(-1, 1, 1), ids)
    (ref_lp * upstream).sum().backward()
    ref_grads = [hidden.grad, *(p.grad for p in head.parameters())]
    assert ent is not None and ref_ent is not None
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-6, rtol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (lp[:, 0] == 0).all() and not ent.requires_grad


def test_chunked_logprobs_at_chosen_positions_only() -> None:
    """`only`: the chosen positions get the full computation's values, the others 0; the gradient of a loss over
    the chosen positions is the full computation's."""
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 40, bias=False)
    hidden = torch.randn(2, 11, 8, requires_grad=True)
    ids = torch.randint(0, 40, (2, 11))
    only = torch.zeros(2, 11)
    only[0, 4:9], only[1, 6:11] = 1, 1
    lp, ent = chunked_logprobs(hidden, head, ids, torch.tensor([0.8, 1.0]), chunk=3, only=only, with_entropy=True)
    lp.sum().backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())  # type: ignore[union-attr]
    hidden.grad, head.weight.grad = None, None
    ref, ref_ent = token_logprobs_and_entropy(head(hidden) / torch.tensor([0.8, 1.0]).view(-1, 1, 1), ids)
    (ref * only).sum().backward()
    assert ent is not None and ref_ent is not None
    torch.testing.assert_close(lp, (ref * only).detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, (ref_ent * only).detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], head.weight.grad, atol=1e-6, rtol=1e-6)
    assert (lp[only == 0] == 0).all() and (lp[only == 1] != 0).all()


def test_chunked_logprobs_upcast_bf16_logits_to_fp32() -> None:
    """bf16 weights and hidden states: the log-softmax is fp32, equal to the fp32 log-softmax of the bf16 logits."""
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 9, 32, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 9), generator=g)
    lp, _ = chunked_logprobs(hidden, head, ids, chunk=4)
    ref, _ = token_logprobs_and_entropy(head(hidden).float(), ids, with_entropy=False)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=1e-6)


def test_token_microbatches_fit_the_budget_and_cover_every_row_once() -> None:
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(5, 120, (40,), generator=g)
    idx = torch.randperm(40, generator=g)[:31]
    parts = token_microbatches(idx, lengths, budget=400, max_rows=6)
    assert sorted(torch.cat(parts).tolist()) == sorted(idx.tolist())
    for p in parts:
        padded = len(p) * int(lengths[p].max())
        assert padded <= 400 or len(p) == 1
        assert len(p) <= 6
    flat = torch.cat(parts)
    assert (lengths[flat][:-1] >= lengths[flat][1:]).all()  # longest first: neighbours are near-equal
    padded_sorted = sum(len(p) * int(lengths[p].max()) for p in parts)
    padded_fixed = sum(len(p) * int(lengths[p].max()) for p in microbatches(idx, 4))
    assert padded_sorted < padded_fixed  # less padding than fixed counts in arrival order
    assert len(token_microbatches(idx, torch.full((40,), 500), budget=400)) == 31  # one over-long row each
    fixed = token_microbatches(idx, lengths, budget=0, max_rows=4)  # budget 0: fixed counts, order kept
    assert [p.tolist() for p in fixed] == [p.tolist() for p in microbatches(idx, 4)]


def test_dtype_resolution_falls_back_to_fp32_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.dtype")
    yes, no = (True, "CPU has amx_bf16"), (False, "CPU has none of amx_bf16, avx512_bf16")
    with caplog.at_level(logging.INFO, logger="test.dtype"):
        assert resolve_dtype("auto", log, support=yes) == "bf16"
        assert resolve_dtype("bf16", log, support=yes) == "bf16"
        assert resolve_dtype("fp32", log, support=yes) == "fp32"
        assert resolve_dtype("auto", log, support=no) == "fp32"
        caplog.clear()
        assert resolve_dtype("bf16", log, support=no) == "fp32"  # asked for, not there: said, and fp32
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "bf16 was asked for" in caplog.text and "amx_bf16" in caplog.text


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    first = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\nbugs\t: none\n"
    )
    info.write_text(first + "\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: amx_bf16\n")  # the first one's
    assert {"avx512_bf16", "amx_tile", "fpu"} <= cpu_flags(info) and "amx_bf16" not in cpu_flags(info)
    assert cpu_flags(tmp_path / "missing") == set()
    assert machine(info) == {"cpu": "AMD EPYC 9R14", "cores": os.cpu_count(), "bf16": ["avx512_bf16"]}
    assert machine(tmp_path / "missing")["cpu"] == "unknown"


def test_core_lists_parse_and_bad_ones_are_named() -> None:
    assert parse_cores("0") == {0} and parse_cores("0-2") == {0, 1, 2} and parse_cores("0, 2-3") == {0, 2, 3}
    for bad in ("a", "2-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="bad core list"):
            parse_cores(bad)


def test_place_pins_the_process_and_sets_torch_threads() -> None:
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before)
    try:
        place(str(core), None)
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="may run on cores"):
            place("4096", None)
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
