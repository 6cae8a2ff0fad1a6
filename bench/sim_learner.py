"""A learner that consumes batches at a set rate, for the control-plane simulation (bench/simulate.py).

    python -m bench.sim_learner --redis-url URL --run-dir RUN --model-dir DIR --step-s 1.0 --out STATS.json \
        [--broadcast | --snapshots]

It does what the learner's service does around a training step (learner/service.py), with the step itself
replaced by a wait of `--step-s`: read a TrainBatch through the consumer group `learner`, count it in a
`LearnerState`, write a snapshot folder (replicas that do not take the broadcast poll it, late joiners start from
it), set the policy version (in the learner's order: written, then announced), broadcast with the real
`WeightSender` (`--broadcast`: the version-fenced rounds of `--model-dir`'s tensors to the replicas in its group),
append the ledger entry, write state.json, acknowledge. The audit (`dapo-mesh audit`) reads the same files it reads
of a real learner. SIGTERM: stops after the batch in hand and
writes, per version, when it was announced and how long the weight sync took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from learner.checkpoint import LearnerState
from mesh.layout import RunLayout
from services.ledger import append, open_ledger
from services.logs import configure_logging
from services.schemas import LedgerEntry, TrainBatch
from services.settings import ServiceSettings
from services.snapshots import snapshot_dir, snapshot_folders, write_atomic, write_latest
from services.streams import GROUP_LEARNER, KEY_POLICY_VERSION, STREAM_BATCHES, StreamConsumer, connect

SIM_PARAM = "w"  # the simulated model's one tensor


def write_model(model_dir: Path, numel: int) -> Path:
    """A model folder with one fp32 tensor of `numel` elements: what the replicas check the broadcast against."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({SIM_PARAM: torch.zeros(numel)}, str(model_dir / "model.safetensors"))
    return model_dir


class SimModule(torch.nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))


def snapshot(hf_dir: Path, version: int, module: SimModule, keep: int = 3) -> Path:
    from safetensors.torch import save_file

    folder = snapshot_dir(hf_dir, version)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({SIM_PARAM: module.w.detach()}, str(folder / "model.safetensors"))
    write_latest(hf_dir, folder)
    for old in snapshot_folders(hf_dir)[:-keep]:
        shutil.rmtree(hf_dir / old, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--step-s", type=float, default=1.0, help="seconds per training step (the wait that replaces it)")
    p.add_argument("--broadcast", action="store_true")
    p.add_argument("--sync-timeout-s", type=float, default=60.0)
    p.add_argument("--sync-max-members", type=int, default=0, help="the broadcast group's cap (0: none)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    configure_logging("sim-learner", ServiceSettings())  # DAPO_LOG_LEVEL, as the services
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from safetensors import safe_open

    with safe_open(str(a.model_dir / "model.safetensors"), "pt") as f:
        module = SimModule(f.get_slice(SIM_PARAM).get_shape()[0])
    stats = run(a, module, stop)
    a.out.write_text(json.dumps(stats))


def run(a: argparse.Namespace, module: SimModule, stop: threading.Event) -> dict[str, object]:
    from prometheus_client import CollectorRegistry

    from learner.settings import LearnerSettings
    from learner.weight_sync import WeightSender

    client = connect(a.redis_url)
    layout = RunLayout(a.run_dir)
    layout.learner.mkdir(parents=True, exist_ok=True)
    consumer = StreamConsumer(client, STREAM_BATCHES, GROUP_LEARNER, "learner-0", TrainBatch)
    sender, registry = None, CollectorRegistry()
    if a.broadcast:
        s = LearnerSettings(
            sync_port=0,
            sync_timeout_s=a.sync_timeout_s,
            sync_max_members=a.sync_max_members,
        )  # the MACs' key: DAPO_SYNC_SECRET from the environment, as the services read it
        sender = WeightSender(s, client, module, registry)
    state, rounds = LearnerState(), []
    next_step = time.monotonic()
    with open_ledger(layout.learner) as ledger:
        while not stop.is_set():
            for d in consumer.read(count=1, block_ms=1000):
                stop.wait(max(0.0, next_step - time.monotonic()))  # the training step
                next_step = time.monotonic() + a.step_s
                batch, digest = d.message, d.message.digest()
                state.advance(batch.batch_id, 1, digest)
                with torch.no_grad():
                    module.w.add_(1.0)  # new weights: the replicas' checksums change with them
                # in the learner's order (learner/service.py): the snapshot written, then the version announced, then
                # the broadcast — a replica told of a version finds its snapshot there
                folder = snapshot(layout.learner / "hf", state.version, module)  # as hf_export: late joiners
                announced = time.time()
                client.set(KEY_POLICY_VERSION, state.version)
                rebuild_s = registry.get_sample_value("dapo_learner_sync_rebuild_seconds_sum") or 0.0
                replicas = 0
                if sender is not None:
                    at, step = str(folder), state.step
                    wv = sender.publish(state.version, step=step, batch_id=batch.batch_id, checkpoint_dir=at)
                    replicas = len(wv.replicas)
                sync_s = time.time() - announced
                rebuilt = (registry.get_sample_value("dapo_learner_sync_rebuild_seconds_sum") or 0.0) - rebuild_s
                rounds.append(
                    dict(
                        version=state.version, announced=announced, sync_s=sync_s, rebuild_s=rebuilt, replicas=replicas
                    )
                )
                entry = LedgerEntry(
                    batch_id=batch.batch_id,
                    digest=digest,
                    version=state.version,
                    pid=os.getpid(),
                    lag=max(0, state.version - 1 - batch.min_version),
                    task_ids=[g.group_id for g in batch.groups],
                )
                append(ledger, entry)
                write_atomic(layout.learner_state, json.dumps(asdict(state)))
                consumer.ack(d.entry_id)  # after the state that holds it is on disk
    if sender is not None:
        sender.close()
    return {"rounds": rounds}


if __name__ == "__main__":
    main()
