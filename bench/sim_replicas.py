"""Simulated rollout replicas: the real replica code without a model (bench/simulate.py starts these processes).

    python -m bench.sim_replicas --redis-url URL --reward-url URL --prefix p0 --count 64 --tokens-per-s 40 \
        --lengths LENGTHS.json --out STATS.json [--broadcast --model-dir DIR | --weights-dir DIR] [--churn 0.1]

Each simulated replica is a thread running what `python -m rollout` runs (rollout/runner.py): `Replica.build` (the
consumer group reader, the publisher that scores through the real reward server and publishes with the
acknowledgement, the membership with its heartbeat thread, the real `WeightReceiver` joining the learner's broadcast
group or the snapshot poll) and the loop a replica runs — `ContinuousLoop.step` (`--loop continuous`, the default,
as a vLLM replica runs) or `ChunkedLoop.step` (`--loop chunked`). Only the engine is simulated: it answers each
prompt with G samples whose lengths are drawn from a recorded run, right with the pass rate written in the prompt,
taking as long as generating the tokens takes at `--tokens-per-s` — `SimEngine` in one sleep per call,
`SimContinuousEngine` step by step, its throughput shared by the sequences in flight and weights loaded between two
steps with them in flight (each token keeps the version that sampled it). It records when each weight version was
loaded; the replica records each prompt's dispatch latency (its stream entry's time to the replica's read).
With `--churn F`, every `--churn-every-s` seconds a fraction F of the replicas leaves (its loop closes, its
heartbeat key is deleted) and as many new ones (new ids) join. SIGTERM: all leave, the stats are written.
"""

from __future__ import annotations

import argparse
import itertools
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
from rollout.continuous_loop import ContinuousLoop
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


class SimContinuousEngine(SimEngine):
    """The ContinuousBatching protocol (rollout/engines/base.py) without a model: each step takes STEP_S, and the
    tokens of the time since the last step at `tokens_per_s` go to the sequences in flight in equal shares; a
    sequence is done when it has its drawn length, a group when its G are; a load between two steps marks each
    sequence's tokens so far (theirs are the old version's, the rest the new one's)."""

    STEP_S = 0.02
    update = "keep"
    draining = False

    def __init__(self, tokenizer: Any, tokens_per_s: float, lengths: list[int], seed: int):
        super().__init__(tokenizer, tokens_per_s, lengths, seed)
        self.groups: dict[str, list[list[Any]]] = {}  # key -> [length, done, answer text, version marks] per sample
        self._last_step: float | None = None  # monotonic end of the last step that ran sequences

    @property
    def chunked(self) -> SimEngine:
        return self

    def in_flight(self, priority: int | None = None) -> int:
        return sum(1 for g in self.groups.values() for seq in g if seq[1] < seq[0])

    def submit(
        self, key: str, prompt: list[int], n: int, params: SamplingParams, *, priority: int = 0, stream: bool = False
    ) -> None:
        m = QUESTION.search(self.tokenizer.decode(prompt))
        answer, p = (m.group(1), float(m.group(2))) if m else ("", 0.0)
        seqs = []
        for _ in range(n):
            text = f"Answer: {answer if self.rng.random() < p else answer + '0'}"
            seqs.append([min(params.max_tokens, self.rng.choice(self.lengths)), 0.0, text, [(self._version, 0)]])
        self.groups[key] = seqs

    def cancel(self, key: str) -> bool:
        return self.groups.pop(key, None) is not None

    def take_deltas(self) -> list[Any]:
        return []

    def abort(self) -> None:
        self.groups.clear()

    def step(self) -> list[tuple[str, list[Completion]]]:
        running = [seq for g in self.groups.values() for seq in g if seq[1] < seq[0]]
        if not running:
            self._last_step = None
            return []
        time.sleep(self.STEP_S)
        # The tokens of the wall time since the last step (at least STEP_S, at most a second): a real engine runs on
        # its own device while its loop does the rest, but these replicas' loops share two cores up to 64 ways, and
        # crediting STEP_S alone would slow the engine by the simulation's own crowding.
        now = time.monotonic()
        last = self._last_step
        self._last_step = now
        dt = self.STEP_S if last is None else min(1.0, max(self.STEP_S, now - last))
        share = self.tokens_per_s * dt / len(running)
        for seq in running:
            seq[1] = min(seq[0], seq[1] + share)
        done = [key for key, g in self.groups.items() if all(seq[1] >= seq[0] for seq in g)]
        return [(key, [self._completion(seq) for seq in self.groups.pop(key)]) for key in done]

    def _completion(self, seq: list[Any]) -> Completion:
        """The sample, each token labelled with the version that held the engine when it was sampled."""
        length, _, text, marks = seq
        per_token: list[int] = []  # marks: (the version loaded, the tokens the sequence had then), in order
        for i, (version, _) in enumerate(marks):
            end = marks[i + 1][1] if i + 1 < len(marks) else length
            per_token += [version] * max(0, min(end, length) - len(per_token))
        runs = tuple((v, len(list(g))) for v, g in itertools.groupby(per_token))
        ids = [self.rng.randrange(VOCAB) for _ in range(length)]
        return Completion(ids, text, [-1.0] * length, "stop", versions=runs or None)

    def _loaded(self, version: int) -> None:
        for g in self.groups.values():
            for seq in g:
                if seq[1] < seq[0]:
                    seq[3].append((version, int(seq[1])))
        super()._loaded(version)


def record_waits(replica: Replica, waits: list[tuple[float, float]]) -> None:
    """Each prompt's wait in the stream (its entry id's time -> the replica's read), whichever loop reads it."""
    read = replica.consumer.read

    def recorded(count: int = 1, block_ms: int = 1000) -> list[Delivery[Any]]:
        deliveries = read(count=count, block_ms=block_ms)
        now = time.time()
        for d in deliveries:
            waits.append((now, now - int(d.entry_id.split("-")[0]) / 1000))
        return deliveries

    replica.consumer.read = recorded  # type: ignore[method-assign]  # the consumer's own read, timed


class SimReplica:
    def __init__(self, name: str, args: argparse.Namespace, tokenizer: Any, lengths: list[int]):
        self.name, self.args = name, args
        seed = zlib.crc32(name.encode())
        self.engine: SimEngine = (
            SimContinuousEngine(tokenizer, args.tokens_per_s, lengths, seed)
            if args.loop == "continuous"
            else SimEngine(tokenizer, args.tokens_per_s, lengths, seed)
        )
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
            max_in_flight=a.max_in_flight,
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
        record_waits(replica, self.waits)
        engine: Any = self.engine  # the Engine protocols, simulated (no model)
        loop = ContinuousLoop(replica, engine) if self.args.loop == "continuous" else ChunkedLoop(replica, engine)
        member = replica.membership
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
    p.add_argument("--loop", choices=("continuous", "chunked"), default="continuous", help="the replicas' loop")
    p.add_argument("--max-in-flight", type=int, default=64, help="sequences a replica runs at once (continuous)")
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
