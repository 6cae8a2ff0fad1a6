"""Runs the buffer: the control loop in the main thread, health and metrics over HTTP in another.

python -m services.buffer --redis-url URL [--dataset reasoning_gym:chain_sum] [--batch-size 8] ...
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from services.buffer.datasets import load_source, write_items
from services.buffer.metrics import BufferMetrics
from services.buffer.service import Buffer
from services.buffer.settings import BufferSettings
from services.common.streams import connect_from
from services.common.web import create_app, serve_in_thread

log = logging.getLogger(__name__)


def run(settings: BufferSettings, stop: threading.Event) -> Buffer:
    s = settings
    client = connect_from(s)
    registry = CollectorRegistry()
    holder: dict[str, Buffer] = {}

    def ready() -> tuple[bool, str]:
        b = holder.get("b")
        return (b is not None and b.status == "running", b.status if b else "loading the dataset")

    server = serve_in_thread(create_app("buffer", s, registry, ready=ready), s)
    try:
        source = load_source(
            s.dataset, size=s.dataset_size, seed=s.dataset_seed, eval_size=s.eval_size,
            config=s.dataset_config, template=s.prompt_template, file_verifier=s.file_verifier,
        )  # fmt: skip
        s.run_dir.mkdir(parents=True, exist_ok=True)
        write_items(s.run_dir / "eval.jsonl", source.eval)  # the held-out split, for evaluation
        log.info("dataset %s: %d training prompts, %d held out", source.name, len(source.train), len(source.eval))
        holder["b"] = buffer = Buffer(s, client, source, BufferMetrics(registry))
        while not stop.is_set():
            buffer.step()
        return buffer
    finally:
        server.should_exit = True
        client.close()
