"""The weight-sync wire: bucket plans, manifests, checksums (pure, no network)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from services.common.weights import Buckets, Manifest, SyncTimeout, checksum, total, wait_keys

SPECS = [
    ("embed", torch.float32, (10, 4)),  # 160 B
    ("norm", torch.bfloat16, (3,)),  # 6 B
    ("w1", torch.float32, (8, 8)),  # 256 B
    ("w2", torch.float32, (2,)),  # 8 B
    ("b", torch.bfloat16, (5,)),  # 10 B
]


def test_buckets_hold_one_dtype_and_respect_the_size() -> None:
    m = Manifest.plan(SPECS, bucket_bytes=300)
    assert sorted(i for _, idx in m.buckets for i in idx) == list(range(len(SPECS)))
    for dt, idx in m.buckets:
        assert {m.params[i][1] for i in idx} == {dt}
        if len(idx) > 1:
            assert (
                sum(torch.empty(m.params[i][2]).numel() for i in idx)
                * torch.empty(0, dtype=getattr(torch, dt)).element_size()
                <= 300
            )
    assert ("float32", [0]) in m.buckets and ("float32", [2, 3]) in m.buckets  # 160 + 256 > 300: a new bucket
    assert ("bfloat16", [1, 4]) in m.buckets
    # 8 bf16 elements are 16 B: whole int64 words already; other counts are padded to whole words
    assert m.bucket_numel(m.buckets.index(("bfloat16", [1, 4]))) == 8
    assert Manifest.plan([("x", torch.bfloat16, (3,))], 100).bucket_numel(0) == 4
    assert Manifest.plan([("x", torch.float32, (3,))], 100).bucket_numel(0) == 4


def test_manifest_round_trip_and_validation() -> None:
    m = Manifest.plan(SPECS, bucket_bytes=1 << 20)
    assert Manifest.from_bytes(m.to_bytes()) == m
    raw = msgpack.unpackb(m.to_bytes())
    raw["buckets"][0][1].pop()  # a parameter no bucket carries
    with pytest.raises(ValueError, match="exactly once"):
        Manifest.from_bytes(msgpack.packb(raw))
    raw = msgpack.unpackb(m.to_bytes())
    raw["params"][0][1] = "float99"
    with pytest.raises(ValueError, match="unknown dtype"):
        Manifest.from_bytes(msgpack.packb(raw))


def test_views_place_each_parameter_and_named_gives_them_back() -> None:
    m = Manifest.plan(SPECS, bucket_bytes=300)
    src = {n: torch.randn(shape).to(dt) for n, dt, shape in SPECS}
    b = Buckets(m)
    for i in range(len(b.buffers)):
        for j, view in b.views(i):
            view.copy_(src[m.params[j][0]])
    got = dict(b.named())
    assert got.keys() == src.keys()
    for n, t in src.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)


def test_checksum_sees_any_changed_word() -> None:
    buf = torch.randn(1000)
    c = checksum(buf)
    assert c == checksum(buf.clone())
    for pos in (0, 499, 999):
        other = buf.clone()
        other[pos] = torch.nextafter(other[pos], torch.tensor(float("inf")))  # one ulp
        assert checksum(other) != c
    assert checksum(torch.zeros(1000)) == 0
    assert total([c, c]) == total([c, c]) and 0 <= total([2**62, 2**62]) < 2**63


def test_wait_keys_times_out_and_cancels() -> None:
    import datetime
    import threading

    import torch.distributed as dist

    from services.common.weights import SyncAborted

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    store.set("a", "1")
    wait_keys(store, ["a"], 0.1)
    with pytest.raises(SyncTimeout, match="b"):
        wait_keys(store, ["a", "b"], 0.2, slice_s=0.05)
    with pytest.raises(SyncAborted):
        wait_keys(store, ["b"], float("inf"), cancelled=lambda: True, slice_s=0.05)
    threading.Timer(0.2, lambda: store.set("c", "1")).start()
    wait_keys(store, ["a", "c"], 5.0)  # answered when "c" appears
