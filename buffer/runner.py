"""Runs the buffer: health and metrics over HTTP from a thread, the control loop here.

    python -m buffer --redis-url URL [--dataset reasoning_gym:chain_sum] [--batch-size 8] ...

Loads the dataset, writes its held-out split (services/datasets.py: eval.jsonl), then leads or stands by: one buffer
of a mesh holds the lease `dapo:buffer:lease` (services/lease.py) and runs `Buffer.step()` (buffer/service.py) until
stopped; any other waits for the lease and, once it has it, starts from what Redis holds (the cursor, the groups the
last leader had not batched). A leader that finds its lease taken (it was paused past the TTL) stands down: its
writes are fenced, so two buffers never put one group in two batches.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from buffer.metrics import BufferMetrics
from buffer.service import Buffer
from buffer.settings import BufferSettings
from services.datasets import Source, eval_items_path, load_source, write_items
from services.lease import Lease
from services.service_process import ServiceProcess
from services.streams import KEY_BUFFER_LEASE, Fenced, TransportError

log = logging.getLogger(__name__)

STANDBY_POLL_S = 1.0  # how often a standby tries the lease (at most a third of its TTL)


def buffer_source(s: BufferSettings) -> Source:
    """The buffer's prompts (training and held out), as its settings describe them; a ValueError says what is wrong
    with the data (also `dapo-mesh up`'s check before it starts anything)."""
    return load_source(
        s.dataset,
        size=s.dataset_size,
        seed=s.dataset_seed,
        eval_size=s.eval_size,
        config=s.dataset_config,
        template=s.prompt_template,
        file_verifier=s.file_verifier,
    )


def run(settings: BufferSettings, stop: threading.Event) -> Buffer | None:
    """Lead while this process holds the lease, stand by while another does; the last Buffer led (None: never)."""
    s = settings
    last: Buffer | None = None
    with ServiceProcess("buffer", s, loading="loading the dataset") as proc:
        source = buffer_source(s)
        s.run_dir.mkdir(parents=True, exist_ok=True)
        write_items(eval_items_path(s.run_dir), source.eval)  # the held-out split, for evaluation
        log.info("dataset %s: %d training prompts, %d held out", source.name, len(source.train), len(source.eval))
        metrics = BufferMetrics(proc.registry)
        holder = f"{s.consumer_name}@{socket.gethostname()}"  # pods of one Deployment share the consumer name
        lease = Lease(proc.client, KEY_BUFFER_LEASE, holder=holder, ttl_ms=s.lease_ttl_ms)
        led: list[Buffer] = []  # the Buffer leading now; empty while standing by
        standby = [f"standing by: waiting for the lease {KEY_BUFFER_LEASE}"]  # /readyz reads this, never Redis
        poll_s = min(s.lease_ttl_ms / 3000, STANDBY_POLL_S)

        def ready() -> tuple[bool, str]:  # from the HTTP thread: a snapshot of `led`
            now = led[:1]
            return (now[0].status == "running", now[0].status) if now else (False, standby[0])

        proc.ready_when(ready)
        try:
            while not stop.is_set():
                if not lease.acquire():
                    who = lease.current_holder() or "nobody (it just ran out)"
                    standby[0] = f"standing by: the lease {KEY_BUFFER_LEASE} is held by {who}"
                    stop.wait(poll_s)
                    continue
                metrics.leader.set(1)
                led[:] = [Buffer(s, proc.client, source, metrics, lease=lease)]  # the state as Redis has it now
                last = led[0]
                fenced = False
                try:
                    while not stop.is_set():
                        last.step()  # renews the lease; Fenced once another buffer leads
                except Fenced as e:
                    log.warning("standing down: %s", e)
                    metrics.stand_downs.inc()
                    fenced = True
                led.clear()
                metrics.stand_down()
                with contextlib.suppress(TransportError):
                    lease.release()  # ours: given up for a successor; taken: a no-op
                if fenced:
                    stop.wait(poll_s)  # a lease that ran out under a slow step: a standby may take it first
        finally:
            with contextlib.suppress(TransportError):  # Redis gone: the lease runs out on its own
                lease.release()
        return last
