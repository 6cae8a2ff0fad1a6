"""An environment server of your own, written from docs/services/environments.md alone: Python's standard library,
nothing of dapo-mesh, in one file — what a user writes in any language and trains against with `dapo-mesh up`.

One environment, `arith`: "What is 7 * 8?" (one-digit operands, + - *), two attempts; after a wrong first answer
the model is told "That is not right. Try again." and answers once more. Reward +1 when an answer is right (the
number after "Answer:", else the last number written), -1 after a second wrong one. A third of the questions are
held out (`split: "eval"`): an evaluation never asks one training saw.

    ARITH_ENV_TOKEN=s3cret python examples/env_server.py --port 8020           # the token: never on a command line
    python -m env_server.conformance http://127.0.0.1:8020 --token-env ARITH_ENV_TOKEN   # 0 failed
    ARITH_ENV_TOKEN=s3cret dapo-mesh up --config configs/agents-external.toml  # the preset names it by URL
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_TURNS = 2
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
QUESTIONS = [(a, op, b) for a in range(10) for b in range(10) for op in OPS if op != "-" or a >= b]
SPEC = {
    "name": "arith",
    "description": "One-digit arithmetic, two attempts, told when the first is wrong.",
    "tools": [],
    "tool_format": "none",
    "max_turns": MAX_TURNS,
}


def split_of(q: tuple[int, str, int]) -> str:
    """A third of the questions held out, the same third every time (by a hash of the question)."""
    digest = hashlib.sha256(f"{q[0]}{q[1]}{q[2]}".encode()).digest()
    return "eval" if digest[0] % 3 == 0 else "train"


POOLS = {split: [q for q in QUESTIONS if split_of(q) == split] for split in ("train", "eval")}
ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d+)", re.IGNORECASE)


def read_answer(text: str) -> int | None:
    found = ANSWER.findall(text) or re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


class Handler(BaseHTTPRequestHandler):
    token: str | None = None
    episodes: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def log_message(self, *_: Any) -> None:
        pass

    def send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, code: int, detail: str) -> None:
        self.send(code, {"detail": detail})

    def authorized(self) -> bool:
        if self.token and self.headers.get("Authorization") != f"Bearer {self.token}":
            self.fail(401, "missing or wrong bearer token")
            return False
        return True

    def body(self) -> Any:
        try:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except ValueError:
            return None

    def do_GET(self) -> None:
        if self.path == "/healthz":  # not required by the protocol: for this server's own probes
            return self.send(200, {"status": "ok"})
        if not self.authorized():
            return None
        if self.path == "/v1/envs":
            return self.send(200, {"protocol": "dapo-env/1", "envs": [SPEC]})
        self.fail(404, "not found")

    def do_POST(self) -> None:
        if not self.authorized():
            return None
        body = self.body()
        if self.path == "/v1/episodes":
            return self.reset(body)
        m = re.fullmatch(r"/v1/episodes/([A-Za-z0-9_.:-]{1,128})/step", self.path)
        if m:
            return self.step(m.group(1), body)
        self.fail(404, "not found")

    def do_DELETE(self) -> None:
        if not self.authorized():
            return None
        m = re.fullmatch(r"/v1/episodes/([A-Za-z0-9_.:-]{1,128})", self.path)
        with self.lock:
            found = m is not None and self.episodes.pop(m.group(1), None) is not None
        if not found or m is None:
            return self.fail(404, "no such episode")
        self.send(200, {"episode_id": m.group(1), "closed": True})

    def reset(self, body: Any) -> None:
        if not isinstance(body, dict) or set(body) - {"env", "episode_id", "seed", "task", "split"}:
            return self.fail(422, "a reset is {env, episode_id?, seed | task, split?}")
        if ("seed" in body and body["seed"] is not None) == ("task" in body and body["task"] is not None):
            return self.fail(422, "give exactly one of seed and task")
        if body.get("env") != "arith":
            return self.fail(404, f"no environment {body.get('env')!r}; there is: ['arith']")
        split = body.get("split", "train")
        if split not in POOLS:
            return self.fail(422, "split: train or eval")
        if body.get("task") is not None:
            q = self.explicit(body["task"])
            if q is None:
                return self.fail(422, 'task: {"a": 0-9, "op": "+" | "-" | "*", "b": 0-9}')
        else:
            seed = body["seed"]
            if not isinstance(seed, int) or seed < 0:
                return self.fail(422, "seed: an integer >= 0")
            pool = POOLS[split]
            q = pool[random.Random(seed).randrange(len(pool))]
        key = json.dumps([body["env"], body.get("seed"), body.get("task"), split], sort_keys=True)
        eid = body.get("episode_id") or uuid.uuid4().hex
        with self.lock:
            if eid in self.episodes:  # a retried reset: the same opening; another task under this id: 409
                ep = self.episodes[eid]
                return self.send(200, ep["opening"]) if ep["key"] == key else self.fail(409, "id in use")
            a, op, b = q
            question = {"role": "user", "content": f"What is {a} {op} {b}?"}
            opening = {"episode_id": eid, "env": "arith", "task_id": f"{a}{op}{b}", "tools": []}
            opening |= {"max_turns": MAX_TURNS, "messages": [question]}
            self.episodes[eid] = {"key": key, "opening": opening, "answer": OPS[op](a, b), "turn": 0, "last": None}
        self.send(200, opening)

    @staticmethod
    def explicit(task: Any) -> tuple[int, str, int] | None:
        if not isinstance(task, dict) or task.get("op") not in OPS:
            return None
        a, b = task.get("a"), task.get("b")
        if isinstance(a, int) and isinstance(b, int) and 0 <= a <= 9 and 0 <= b <= 9:
            return a, task["op"], b
        return None

    def step(self, eid: str, body: Any) -> None:
        msg = body.get("message") if isinstance(body, dict) else None
        turn = body.get("turn") if isinstance(body, dict) else None
        if not isinstance(msg, dict) or msg.get("role") != "assistant" or not isinstance(turn, int) or turn < 1:
            return self.fail(422, "a step is {turn: int >= 1, message: {role: assistant, content}}")
        text = str(msg.get("content", ""))
        with self.lock:
            ep = self.episodes.get(eid)
            if ep is None:
                return self.fail(404, "no such episode (never opened here, closed, or expired)")
            if ep["last"] is not None and turn == ep["turn"]:  # a retried step: the same answer, not run again
                if text != ep["message"]:
                    return self.fail(409, f"turn {turn} was answered for another message")
                return self.send(200, ep["last"])
            if ep["last"] is not None and ep["last"]["done"]:
                return self.fail(409, "the episode is done")
            if turn != ep["turn"] + 1:
                return self.fail(409, f"turn {turn}: the next turn is {ep['turn'] + 1}")
            ep["turn"], ep["message"], ep["last"] = turn, text, self.judge(ep, text, turn)
            out = ep["last"]
        self.send(200, out)

    @staticmethod
    def judge(ep: dict[str, Any], text: str, turn: int) -> dict[str, Any]:
        if read_answer(text) == ep["answer"]:
            return {"messages": [], "reward": 1.0, "done": True}
        if turn >= MAX_TURNS:  # out of attempts: the game's own end (not a cut), a failure
            return {"messages": [], "reward": -1.0, "done": True}
        return {"messages": [{"role": "user", "content": "That is not right. Try again."}], "done": False}


def make_server(host: str, port: int, token: str | None) -> ThreadingHTTPServer:
    handler = type("ArithHandler", (Handler,), {"token": token, "episodes": {}, "lock": threading.Lock()})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8020)
    p.add_argument("--token-env", default="ARITH_ENV_TOKEN", help="The variable holding the bearer token (optional).")
    a = p.parse_args()
    server = make_server(a.host, a.port, os.environ.get(a.token_env) or None)
    print(f"arith environment server on http://{a.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
