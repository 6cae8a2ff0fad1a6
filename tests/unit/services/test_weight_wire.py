"""The weight-sync wire: bucket plans, manifests, checksums (pure, no network)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch

from services.weight_wire import (
    BadRound,
    Buckets,
    Manifest,
    SyncTimeout,
    check_mac,
    check_manifest,
    checksum,
    mac,
    model_specs,
    total,
    wait_keys,
)

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

    from services.weight_wire import SyncAborted

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    store.set("a", "1")
    wait_keys(store, ["a"], 5.0)  # present: answered at once (a 0.1 s budget flaked on a loaded machine)
    with pytest.raises(SyncTimeout, match="b"):
        wait_keys(store, ["a", "b"], 0.2, slice_s=0.05)
    with pytest.raises(SyncAborted):
        wait_keys(store, ["b"], float("inf"), cancelled=lambda: True, slice_s=0.05)
    threading.Timer(0.2, lambda: store.set("c", "1")).start()
    wait_keys(store, ["a", "c"], 5.0)  # answered when "c" appears


def test_macs_bind_key_and_every_part() -> None:
    tag = mac(b"k", "round", 3, 0, 7, b"sums")
    check_mac(b"k", tag, "round", 3, 0, 7, b"sums")
    for wrong in [(b"other", ("round", 3, 0, 7, b"sums")), (b"k", ("round", 3, 0, 8, b"sums")),
                  (b"k", ("round", 4, 0, 7, b"sums")), (b"k", ("round", 3, 0, 7, b"sumz")),
                  (b"k", ("round", 30, 7, b"sums"))]:  # fmt: skip
        with pytest.raises(BadRound, match="MAC does not match"):
            check_mac(wrong[0], tag, *wrong[1])
    assert mac(b"k", "ab", "c") != mac(b"k", "a", "bc")  # parts are length-prefixed


def test_a_manifest_must_fit_the_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {"embed": torch.zeros(10, 4), "w1": torch.zeros(8, 8), "norm": torch.zeros(3)}, tmp_path / "m.safetensors"
    )
    expected = model_specs(tmp_path)
    assert expected == {"embed": (10, 4), "w1": (8, 8), "norm": (3,)}
    good = [("embed", torch.float32, (10, 4)), ("w1", torch.bfloat16, (8, 8)), ("norm", torch.float32, (3,))]
    check_manifest(Manifest.plan(good, 300), expected)
    cases = {
        "lacks parameters": good[:2],
        "which this model does not have": [*good, ("evil", torch.float32, (1,))],
        r"shape \(8, 9\)": [good[0], ("w1", torch.float32, (8, 9)), good[2]],
        "dtype int64": [good[0], ("w1", torch.int64, (8, 8)), good[2]],
        "twice": [*good, good[0]],
    }
    for match, specs in cases.items():
        with pytest.raises(BadRound, match=match):
            check_manifest(Manifest.plan(specs, 300), expected)
    with pytest.raises(FileNotFoundError):
        model_specs(tmp_path / "none")
