"""Runs the buffer: health and metrics over HTTP from a thread, the control loop here.

    python -m buffer --redis-url URL [--dataset reasoning_gym:chain_sum] [--batch-size 8] ...

Loads the dataset, writes its held-out split (services/datasets.py: eval.jsonl), then runs
`Buffer.step()` (buffer/service.py) until stopped.
"""

from __future__ import annotations

import logging
import threading

from buffer.metrics import BufferMetrics
from buffer.service import Buffer
from buffer.settings import BufferSettings
from services.datasets import Source, eval_items_path, load_source, write_items
from services.service_process import ServiceProcess

log = logging.getLogger(__name__)


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


def run(settings: BufferSettings, stop: threading.Event) -> Buffer:
    s = settings
    with ServiceProcess("buffer", s, loading="loading the dataset") as proc:
        source = buffer_source(s)
        s.run_dir.mkdir(parents=True, exist_ok=True)
        write_items(eval_items_path(s.run_dir), source.eval)  # the held-out split, for evaluation
        log.info("dataset %s: %d training prompts, %d held out", source.name, len(source.train), len(source.eval))
        buffer = Buffer(s, proc.client, source, BufferMetrics(proc.registry))
        proc.ready_when(lambda: (buffer.status == "running", buffer.status))
        while not stop.is_set():
            buffer.step()
        return buffer
