"""Simulated rollout replicas: the real replica code without a model (bench/simulate.py starts these processes).

    python -m bench.sim_replicas --redis-url URL --reward-url URL --prefix p0 --count 64 --tokens-per-s 40 \
        --lengths LENGTHS.json --out STATS.json [--broadcast --model-dir DIR | --weights-dir DIR] [--churn 0.1]

Each simulated replica is a thread running what `python -m rollout` runs (rollout/runner.py) with the chunked loop:
`Replica.build` (the consumer group reader, the publisher that scores through the real reward server and publishes
with the acknowledgement, the membership with its heartbeat thread, the real `WeightReceiver` joining the learner's
broadcast group or the snapshot poll), `ChunkedLoop.step`. Only the engine is simulated: `SimEngine` answers each
prompt with G samples whose lengths are drawn from a recorded run, right with the pass rate written in the prompt,
and sleeps for as long as generating the tokens takes at `--tokens-per-s`. It records when each weight version was
loaded; the loop records each prompt's dispatch latency (its stream entry's time to the replica's read).
With `--churn F`, every `--churn-every-s` seconds a fraction F of the replicas leaves (its loop closes, its
heartbeat key is deleted) and as many new ones (new ids) join. SIGTERM: all leave, the stats are written.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from learner.tiny import VOCAB, tiny_tokenizer
from rollout.chunked_loop import ChunkedLoop
from rollout.engines.base import Completion, SamplingParams, counts
from rollout.replica import Replica
from services.logs import configure_logging
from services.settings import ServiceSettings
from services.streams import Delivery

QUESTION = re.compile(r"reply (\d+) \(pass rate ([0-9.]+)\)")


def question(i: int, answer: int, pass_rate: float) -> str:
    """A simulated task's prompt: the answer and the pass rate are in the text, for the simulated engine to read."""
    return f"Simulated task {i}: reply {answer} (pass rate {pass_rate:.3f})."


class SimEngine:
    """An `Engine` (rollout/engines/base.py) without a model."""

    dtype = "fp32"

    def __init__(self, tokenizer: Any, tokens_per_s: float, lengths: list[int], seed: int):
        self.tokenizer, self.tokens_per_s, self.lengths = tokenizer, tokens_per_s, lengths
        self.rng = random.Random(seed)
        self._version = 0
        self.loads: list[tuple[int, float]] = []  # (version, time.time() when loaded)

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        outs, tokens = [], 0
        for ids, k in zip(prompts, counts(prompts, n), strict=True):
            m = QUESTION.search(self.tokenizer.decode(ids))
            answer, p = (m.group(1), float(m.group(2))) if m else ("", 0.0)
            group = []
            for _ in range(k):
                length = min(params.max_tokens, self.rng.choice(self.lengths))
                right = self.rng.random() < p
                text = f"Answer: {answer if right else answer + '0'}"
                ids_out = [self.rng.randrange(VOCAB) for _ in range(length)]
                group.append(Completion(ids_out, text, [-1.0] * length, "stop"))
                tokens += length
            outs.append(group)
        time.sleep(tokens / self.tokens_per_s)
        return outs

    def _loaded(self, version: int) -> None:
        self._version = version
        self.loads.append((version, time.time()))

    def load_weights(self, hf_dir: Path, version: int) -> None:
        self._loaded(version)

    def load_tensors(self, named: Any, version: int, *, adapter: Any = None) -> None:
        for _ in named:
            pass
        self._loaded(version)


class SimLoop(ChunkedLoop):
    """The chunked loop, recording how long each prompt waited in the stream (entry id time -> read)."""

    def __init__(self, replica: Replica, engine: SimEngine, waits: list[tuple[float, float]]):
        super().__init__(replica, engine)
        self.waits = waits

    def read(self) -> list[Delivery[Any]]:
        deliveries = super().read()
        now = time.time()
        for d in deliveries:
            self.waits.append((now, now - int(d.entry_id.split("-")[0]) / 1000))
        return deliveries


class SimReplica:
    def __init__(self, name: str, args: argparse.Namespace, tokenizer: Any, lengths: list[int]):
        self.name, self.args = name, args
        self.engine = SimEngine(tokenizer, args.tokens_per_s, lengths, seed=zlib.crc32(name.encode()))
        self.waits: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.error: str | None = None
        self.left: float | None = None  # time.time() when it stopped

    def settings(self) -> Any:
        from rollout.settings import RolloutSettings

        a = self.args
        return RolloutSettings(
            replica_id=self.name,
            redis_url=a.redis_url,
            reward_url=a.reward_url,
            engine="hf",
            model_dir=a.model_dir,
            prompts_per_call=1,
            sync_broadcast=a.broadcast,
            weights_dir=a.weights_dir,
            sync_device="cpu",
            heartbeat_ttl_s=a.heartbeat_ttl_s,
            max_response_tokens=max(self.engine.lengths),
        )

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 -- a replica that fails is reported, the others go on
            self.error = f"{type(e).__name__}: {e}"
        self.left = time.time()

    def _run(self) -> None:
        from prometheus_client import CollectorRegistry

        from rollout.metrics import RolloutMetrics
        from rollout.reward_client import RewardClient
        from rollout.weight_receiver import WeightReceiver
        from services.streams import connect

        s = self.settings()
        client = connect(s.require_redis_url())
        metrics = RolloutMetrics(CollectorRegistry())
        receiver = WeightReceiver(s, client, metrics) if s.sync_broadcast else None
        reward = RewardClient(s.reward_url, timeout_s=s.reward_timeout_s, retries=s.reward_retries)
        replica = Replica.build(s, client, self.engine, reward, metrics, receiver)  # type: ignore[arg-type]
        loop, member = SimLoop(replica, self.engine, self.waits), replica.membership
        member.sync_weights()
        member.warm_up()
        member.heartbeat()
        beat_stop = threading.Event()
        beat = threading.Thread(target=member.heartbeat_forever, args=(beat_stop,), daemon=True)
        beat.start()
        threading.Thread(target=member.leave_when, args=(self.stop, beat_stop), daemon=True).start()
        if receiver is not None:
            threading.Thread(target=receiver.run, args=(beat_stop,), daemon=True).start()
        try:
            while not self.stop.is_set():
                loop.step()
            loop.close()
        finally:
            beat_stop.set()
            beat.join(10)
            reward.close()
            client.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--reward-url", required=True)
    p.add_argument("--prefix", default="sim")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--tokens-per-s", type=float, default=100.0)
    p.add_argument("--lengths", type=Path, required=True, help="JSON list of response lengths to draw from")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True, help="the weights' shapes (the broadcast's manifest)")
    p.add_argument("--broadcast", action="store_true", help="join the learner's broadcast group")
    p.add_argument("--weights-dir", type=Path, default=None, help="else: poll the learner's snapshots here")
    p.add_argument("--heartbeat-ttl-s", type=float, default=15.0)
    p.add_argument("--churn", type=float, default=0.0, help="fraction of replicas replaced every --churn-every-s")
    p.add_argument("--churn-every-s", type=float, default=60.0)
    p.add_argument("--stagger-s", type=float, default=0.05, help="between two replicas' starts")
    a = p.parse_args(argv)
    configure_logging("sim-replicas", ServiceSettings())  # DAPO_LOG_LEVEL, as the services
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tokenizer, lengths = tiny_tokenizer(), json.loads(a.lengths.read_text())
    made = 0

    def start() -> SimReplica:
        nonlocal made
        r = SimReplica(f"{a.prefix}-{made}", a, tokenizer, lengths)
        made += 1
        r.thread.start()
        return r

    live, gone = [], []
    for _ in range(a.count):
        live.append(start())
        stop.wait(a.stagger_s)
    next_churn = time.monotonic() + a.churn_every_s
    while not stop.wait(0.5):
        if a.churn and time.monotonic() >= next_churn:
            next_churn += a.churn_every_s
            leaving = random.sample(live, max(1, round(a.churn * len(live))))
            for r in leaving:
                r.stop.set()
                live.remove(r)
                gone.append(r)
            live += [start() for _ in leaving]
    for r in live:
        r.stop.set()
    for r in live + gone:
        r.thread.join(30)
    everyone = gone + live
    stats = [
        {"name": r.name, "loads": r.engine.loads, "waits": r.waits, "error": r.error, "left": r.left} for r in everyone
    ]
    a.out.write_text(json.dumps({"replicas": stats}))


if __name__ == "__main__":
    main()
