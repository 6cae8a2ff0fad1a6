"""The weight-sync wire, shared by the sender (learner/weight_sync.py) and the receivers (rollout/weight_receiver.py).

Parameters travel as flat buckets (one dtype each, ~64 MB), in a torch.distributed process group of
their own: gloo when the tensors are on CPUs, NCCL when they are on GPUs (the same code). The group is
built from the learner's own TCPStore (never DeepSpeed's world group) and is rebuilt only when the
membership changes. One *generation* is one group with fixed members; every version is one *round*.

Redis    dapo:sync:generation        INCR counter: generations stay monotonic across learner restarts
         dapo:sync:group             SyncGroup{generation, host, port, candidates, timeout_s}
         dapo:weights                WeightVersion of the last round (version, checksum, replicas)
TCPStore (the learner's), keys under g<generation>/:
         manifest                    msgpack {params: [[name, dtype, shape]...], buckets: [[dtype, [i...]]...],
                                     adapter: {base, rank, alpha, targets} when the params are a LoRA adapter}
         join/<replica>              a candidate has arrived
         roster                      msgpack [replica ids]: rank = index + 1 (the learner is rank 0);
                                     [] when the generation did not form
         round/<n>                   msgpack {version}: the buckets follow as broadcasts from rank 0;
                                     or {closed: true}: the learner has ended this generation
         round/<n>/sums              msgpack [checksum per bucket], after the last bucket
         round/<n>/ack/<replica>     msgpack {ok, checksum, error}: the replica verified (or not) the round
         round/<n>/abort             the learner gave up on the round (a member died): stop waiting, ack

Authentication: the manifest and each round's checksums carry an HMAC-SHA256 (`manifest/mac`,
`round/<n>/mac`) keyed with the shared secret (DAPO_SYNC_SECRET, else the mesh's auth token), over the
generation, the round, the version and the bytes; a replica checks the manifest's MAC and the manifest itself
against its own model (names, shapes, float dtypes, total bytes) before it allocates anything, and a round's
MAC before it loads the round. Without any secret the MAC is unkeyed (integrity only). The checksums are
additive, not cryptographic: against someone who can rewrite the broadcast stream itself, keep the sync
traffic on a private network (the NetworkPolicies) — the MAC stops a forged learner or store.

Every wait on either side has a deadline. A replica that does not join, or does not acknowledge a round
within the timeout, is dropped from the group; the next version rebuilds it without that replica.

The checksum of a bucket is the sum, modulo 2^64, of its bytes read as int64 words (buckets are padded
to 8 bytes): exact in any summation order, ~40 GB/s on a CPU core, computed where the bucket lives (also
on a GPU), so every round is verified on both sides; it catches truncated or corrupted buckets.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from services.adapters import AdapterInfo, check_adapter
from services.streams import KEY_SYNC_GENERATION, KEY_SYNC_GROUP, KEY_WEIGHTS

__all__ = ["KEY_SYNC_GENERATION", "KEY_SYNC_GROUP", "KEY_WEIGHTS"]  # defined with the other Redis keys
CHECKSUM_MASK = (1 << 63) - 1


class SyncTimeout(TimeoutError):
    """A peer did not show up (join, acknowledgement, bucket) within the round's timeout."""


class SyncAborted(RuntimeError):
    """The generation ended (closed by the learner, superseded, or the learner went away)."""


class BadRound(RuntimeError):
    """What the learner sent is not to be loaded: a wrong MAC, or a manifest that does not fit this model."""


FLOAT_DTYPES = {"float32", "bfloat16", "float16"}


def mac(key: bytes, *parts: bytes | int | str) -> bytes:
    """HMAC-SHA256 over the parts, each length-prefixed (so that no two part lists give the same message)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        raw = p if isinstance(p, bytes) else str(p).encode()
        h.update(struct.pack(">Q", len(raw)) + raw)
    return h.hexdigest().encode()


def sync_key(settings: Any) -> bytes:
    """The MAC key of a learner's or replica's settings: DAPO_SYNC_SECRET, else the auth token, else none."""
    secret = getattr(settings, "sync_secret", None) or getattr(settings, "auth_token", None)
    return secret.get_secret_value().encode() if secret is not None else b""


def check_mac(key: bytes, got: bytes, *parts: bytes | int | str) -> None:
    if not hmac.compare_digest(got, mac(key, *parts)):
        raise BadRound("the MAC does not match: another secret, or not our learner")


def model_specs(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of an HF safetensors folder, from the files' headers (nothing is loaded)."""
    specs: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        specs |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    if not specs:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return specs


def check_manifest(
    manifest: Manifest, expected: dict[str, tuple[int, ...]], *, base: str | None = None, max_rank: int | None = None
) -> None:
    """The manifest describes this model's parameters: the same names and shapes, float dtypes, and so no more
    bytes than the model in fp32 (padding aside). A replica serving LoRA adapters (`max_rank`, its base model's
    fingerprint `base`): an adapter of this base model, of a rank it serves (services/adapters.py). Raises BadRound
    naming the first difference."""
    names = [n for n, _, _ in manifest.params]
    if len(set(names)) != len(names):
        raise BadRound("the manifest names a parameter twice")
    if (manifest.adapter is None) != (max_rank is None):
        raise BadRound(
            "the learner sends a LoRA adapter and this replica serves full weights: start it with --lora-max-rank"
            if max_rank is None
            else "the learner sends full weights and this replica serves LoRA adapters: start the learner with "
            "--lora-rank, or the replica without --lora-max-rank"
        )
    if manifest.adapter is not None:
        assert max_rank is not None and base is not None
        try:
            check_adapter(manifest.adapter, [(n, s) for n, _, s in manifest.params], expected, base, max_rank)
        except ValueError as e:
            raise BadRound(str(e)) from e
        if bad := [n for n, dt, _ in manifest.params if dt not in FLOAT_DTYPES]:
            raise BadRound(f"{bad[0]}: not a float dtype")
        return
    if missing := sorted(set(expected) - set(names) - {"lm_head.weight"}):  # a tied head is not sent
        raise BadRound(f"the manifest lacks parameters of this model: {missing[:5]}")
    for name, dt, shape in manifest.params:
        if name not in expected:
            raise BadRound(f"the manifest names {name!r}, which this model does not have")
        if tuple(shape) != expected[name]:
            raise BadRound(f"{name}: shape {tuple(shape)} in the manifest, {expected[name]} in this model")
        if dt not in FLOAT_DTYPES:
            raise BadRound(f"{name}: dtype {dt} is not one of {sorted(FLOAT_DTYPES)}")
    limit = sum(_numel(s) for s in expected.values()) * 4 + 8 * len(manifest.buckets)
    if manifest.nbytes > limit:
        raise BadRound(f"the manifest asks for {manifest.nbytes} bytes; this model needs at most {limit}")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the weight manifest")
    return dtype


@dataclass(frozen=True)
class Manifest:
    """Names, dtypes and shapes of the parameters, and how they are packed into buckets."""

    params: list[tuple[str, str, tuple[int, ...]]]  # name, dtype ("float32"), shape
    buckets: list[tuple[str, list[int]]]  # dtype, indices into params
    adapter: AdapterInfo | None = None  # LoRA: the params are an adapter of this base model (services/adapters.py)

    @classmethod
    def plan(
        cls,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        bucket_bytes: int,
        adapter: AdapterInfo | None = None,
    ) -> Manifest:
        params = [
            (name, str(dtype).removeprefix("torch."), tuple(int(x) for x in shape)) for name, dtype, shape in specs
        ]
        open_: dict[str, tuple[list[int], int]] = {}  # dtype -> (indices, bytes) of the bucket being filled
        buckets: list[tuple[str, list[int]]] = []
        for i, (_, dt, shape) in enumerate(params):
            size = _numel(shape) * dtype_of(dt).itemsize
            idx, used = open_.get(dt, ([], 0))
            if idx and used + size > bucket_bytes:
                buckets.append((dt, idx))
                idx, used = [], 0
            open_[dt] = (idx + [i], used + size)
        buckets += [(dt, idx) for dt, (idx, _) in open_.items() if idx]
        return cls(params, buckets, adapter)

    def bucket_numel(self, b: int) -> int:
        """Elements in bucket b, padded so that its bytes are a multiple of 8 (the checksum reads int64)."""
        dt, idx = self.buckets[b]
        n = sum(_numel(self.params[i][2]) for i in idx)
        per_word = max(1, 8 // dtype_of(dt).itemsize)
        return -(-n // per_word) * per_word

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_numel(b) * dtype_of(dt).itemsize for b, (dt, _) in enumerate(self.buckets))

    def to_bytes(self) -> bytes:
        out: dict[str, Any] = {"params": [[n, d, list(s)] for n, d, s in self.params], "buckets": self.buckets}
        if self.adapter is not None:
            out["adapter"] = self.adapter.to_dict()
        return msgpack.packb(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        raw = msgpack.unpackb(data)
        params = [(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in raw["params"]]
        for _, d, _ in params:
            dtype_of(d)
        buckets = [(str(d), [int(i) for i in idx]) for d, idx in raw["buckets"]]
        if sorted(i for _, idx in buckets for i in idx) != list(range(len(params))):
            raise ValueError("weight manifest: buckets do not cover every parameter exactly once")
        adapter = raw.get("adapter")
        return cls(params, buckets, None if adapter is None else AdapterInfo.from_dict(adapter))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


class Buckets:
    """Flat buffers laid out by a manifest, and views of each parameter inside them."""

    def __init__(self, manifest: Manifest, device: torch.device | str = "cpu"):
        self.manifest = manifest
        self.buffers = [
            torch.zeros(manifest.bucket_numel(b), dtype=dtype_of(dt), device=device)
            for b, (dt, _) in enumerate(manifest.buckets)
        ]

    def views(self, b: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(parameter index, view into bucket b shaped like the parameter)."""
        off = 0
        for i in self.manifest.buckets[b][1]:
            shape = self.manifest.params[i][2]
            n = _numel(shape)
            yield i, self.buffers[b][off : off + n].view(shape)
            off += n

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for b in range(len(self.buffers)):
            for i, view in self.views(b):
                yield self.manifest.params[i][0], view


def checksum(buf: torch.Tensor) -> int:
    """Sum of the buffer's bytes as int64 words, modulo 2^64 (its byte length must be a multiple of 8)."""
    words = buf.detach().reshape(-1).view(torch.uint8).view(torch.int64)
    return int(words.sum().item()) & CHECKSUM_MASK


def total(sums: Sequence[int]) -> int:
    """One number for a whole set of weights: what replicas report in their heartbeat."""
    return sum(sums) & CHECKSUM_MASK


def make_group(store: Any, rank: int, size: int, timeout_s: float, device: torch.device) -> Any:
    """A process group on `store` beside any world group: NCCL for CUDA tensors, gloo otherwise."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def make_group_until(
    store: Any, rank: int, size: int, timeout_s: float, device: torch.device, cancelled: Callable[[], bool]
) -> Any:
    """`make_group`, given up as soon as `cancelled()` turns true (asked every 20 ms): a member left while the group
    was forming, or the learner gave the generation up. The constructor itself blocks until every rank has connected
    or the timeout, whoever has left: it runs in a thread of its own, and one given up ends at its timeout (a group
    it forms after all is aborted at once). Raises SyncAborted when given up."""
    box: dict[str, Any] = {}
    given_up = threading.Event()

    def build() -> None:
        try:
            box["pg"] = make_group(store, rank, size, timeout_s, device)
            if given_up.is_set():
                box["pg"].abort()
        except Exception as e:  # noqa: BLE001 -- handed to the caller (or dropped, when given up)
            box["error"] = e

    t = threading.Thread(target=build, name="sync-group", daemon=True)
    t.start()
    while t.is_alive():
        if cancelled():
            given_up.set()
            raise SyncAborted("the group was given up while it formed")
        t.join(0.02)
    if "error" in box:
        raise box["error"]
    return box["pg"]


def broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float, interrupted: Callable[[], bool] | None = None) -> None:
    """Broadcast from rank 0. The wait is a poll, so that it can end early: `interrupted()` (asked every
    20 ms) turning true raises SyncAborted — a peer's failure does not always reach the others' sockets,
    so the learner says "abort" through the store. SyncTimeout at the deadline. The caller aborts the group."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    work = pg.broadcast([tensor], opts)
    deadline = time.monotonic() + timeout_s
    next_ask = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise SyncTimeout(f"broadcast of {tensor.numel()} elements took over {timeout_s:.0f} s")
        if interrupted is not None and now >= next_ask:
            if interrupted():
                raise SyncAborted("the round was aborted")
            next_ask = now + 0.02
        time.sleep(0.001)
    work.wait()  # raises what the transport raised (a peer's connection closed, ...)
    if tensor.is_cuda:
        torch.cuda.current_stream().synchronize()


def store_server(host: str, port: int, timeout_s: float) -> Any:
    """The learner's store, listening on `host` only (TCPStore itself would listen on every interface). The
    store owns the listening socket: it closes it when it goes."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def store_client(host: str, port: int, timeout_s: float, connect_s: float = 10.0) -> Any:
    """A client of the learner's store: a dead address fails within `connect_s`, waits within `timeout_s`."""
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=min(connect_s, timeout_s)), wait_for_workers=False)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def wait_keys(
    store: Any,
    keys: Sequence[str],
    timeout_s: float,
    *,
    cancelled: Callable[[], bool] = lambda: False,
    slice_s: float = 1.0,
    poll_s: float | None = None,
) -> None:
    """Block until every key exists: the store answers when they do (no polling). The wait runs in
    slices so that `cancelled()` is seen within `slice_s`. Raises SyncTimeout at the deadline, SyncAborted
    when cancelled, and torch's DistNetworkError when the store's server has gone away.

    With `poll_s`, ask every poll_s instead: for long idle waits (c10d logs a warning per timed-out slice)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [k for k in keys if not store.check([k])]
            raise SyncTimeout(f"waited {timeout_s:.0f} s for {', '.join(missing)}")
        if poll_s is not None:
            if store.check(list(keys)):
                return
            if cancelled():
                raise SyncAborted("cancelled")
            time.sleep(min(poll_s, left))
            continue
        try:
            store.wait(list(keys), timedelta(seconds=min(slice_s, left)))
            return
        except dist.DistStoreError:  # this slice timed out
            if cancelled():
                raise SyncAborted("cancelled") from None
