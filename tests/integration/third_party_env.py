"""A third-party environment server, written from docs/services/environments.md alone: the standard library's
HTTP server and JSON, nothing of dapo-mesh. One environment, `guess` (a number from 1 to 5, three tries, told
higher or lower), under another name if asked. With a token, every request must carry it (401 otherwise). `bug`
makes it break one rule of the protocol, to show the conformance checker and the mesh notice: `retry` (a retried
step runs again), `endless` (an episode that never ends), `proxy` (a reset answered with a proxy's HTML page, 200),
`shape` (a reset answered with JSON of the wrong shape), `step_error` (every step answered with `error`). `coin` is
no bug: every episode ends at its first step, right (+1) with chance 0.35 whatever the answer, drawn from its
episode id — outcomes that vary for a random model (groups sampled in rounds find both).

    with serve(bug=None, name="guess", token=None) as url: ...
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SPEC = {"name": "guess", "description": "Guess a number from 1 to 5.", "tools": [], "tool_format": "none",
        "max_turns": 3}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    episodes: dict[str, dict[str, Any]]
    stats: dict[str, int]
    bug: str | None
    name: str = "guess"
    token: str | None = None

    def log_message(self, *_: Any) -> None:
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.token is None or self.headers.get("Authorization") == f"Bearer {self.token}":
            return True
        self._send(401, {"detail": "missing or wrong bearer token"})
        return False

    def _body(self) -> Any:
        try:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except ValueError:
            return None

    def do_GET(self) -> None:
        if not self._authorized():
            return None
        if self.path == "/debug/episodes":  # not the protocol's: what the tests look at (episodes held open)
            return self._send(200, sorted(self.episodes))
        if self.path == "/debug/stats":  # ... and how many resets and steps it answered
            return self._send(200, self.stats)
        if self.path == "/v1/envs":
            return self._send(200, {"protocol": "dapo-env/1", "envs": [{**SPEC, "name": self.name}]})
        self._send(404, {"detail": "not found"})

    def do_DELETE(self) -> None:
        if not self._authorized():
            return None
        m = re.fullmatch(r"/v1/episodes/([^/]+)", self.path)
        if m and self.episodes.pop(m.group(1), None) is not None:
            return self._send(200, {"episode_id": m.group(1), "closed": True})
        self._send(404, {"detail": "no such episode"})

    def do_POST(self) -> None:
        if not self._authorized():
            return None
        body = self._body()
        if self.path == "/v1/episodes":
            return self._reset(body)
        m = re.fullmatch(r"/v1/episodes/([^/]+)/step", self.path)
        if m:
            return self._step(m.group(1), body)
        self._send(404, {"detail": "not found"})

    def _reset(self, body: Any) -> None:
        if not isinstance(body, dict) or ("seed" in body) == ("task" in body):
            return self._send(422, {"detail": "give exactly one of seed and task"})
        if body.get("env") != self.name:
            return self._send(404, {"detail": f"no environment {body.get('env')!r}"})
        if self.bug == "proxy":
            return self._page(b"<html><body>502 Bad Gateway (nginx)</body></html>")
        if self.bug == "shape":
            return self._send(200, {"episode": "x", "text": "Guess my number."})
        eid = body.get("episode_id") or f"ep{random.getrandbits(64):x}"
        key = json.dumps([body.get("seed"), body.get("task")])
        if eid in self.episodes:
            ep = self.episodes[eid]
            return self._send(200, ep["opening"]) if ep["key"] == key else self._send(409, {"detail": "in use"})
        secret = random.Random(body.get("seed", 0)).randint(1, 5)
        opening = {"episode_id": eid, "env": self.name, "task_id": f"secret-{secret}", "tools": [], "max_turns": 3,
                   "messages": [{"role": "user", "content": "Guess my number from 1 to 5."}]}  # fmt: skip
        self.episodes[eid] = {"key": key, "opening": opening, "secret": secret, "turn": 0, "last": None, "eid": eid}
        self.stats["resets"] += 1
        self._send(200, opening)

    def _step(self, eid: str, body: Any) -> None:
        msg = body.get("message") if isinstance(body, dict) else None
        if not isinstance(msg, dict) or msg.get("role") != "assistant" or not isinstance(body.get("turn"), int):
            return self._send(422, {"detail": "a step is {turn: int, message: {role: assistant, content}}"})
        ep = self.episodes.get(eid)
        if ep is None:
            return self._send(404, {"detail": "no such episode"})
        turn = body["turn"]
        if ep["last"] is not None and turn == ep["turn"] and self.bug != "retry":
            return self._send(200, ep["last"])
        if ep["last"] is not None and ep["last"]["done"]:
            return self._send(409, {"detail": "done"})
        if turn != ep["turn"] + 1:
            return self._send(409, {"detail": f"the next turn is {ep['turn'] + 1}"})
        ep["turn"], ep["last"] = turn, self._judge(ep, str(msg.get("content", "")), turn)
        self.stats["steps"] += 1
        self._send(200, ep["last"])

    def _page(self, html: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(html)))
        self.end_headers()
        self.wfile.write(html)

    def _judge(self, ep: dict[str, Any], text: str, turn: int) -> dict[str, Any]:
        if self.bug == "step_error":
            return {"messages": [], "done": True, "error": "the game's process died"}
        if self.bug == "coin":
            right = random.Random(ep["eid"]).random() < 0.35
            return {"messages": [], "reward": 1.0 if right else -1.0, "done": True}
        numbers = re.findall(r"\d+", text)
        guess = int(numbers[-1]) if numbers else 0
        if guess == ep["secret"]:
            return {"messages": [], "reward": 1.0, "done": True}
        if turn >= 3 and self.bug != "endless":
            return {"messages": [], "reward": -1.0, "done": True, "truncated": True}
        hint = "higher" if guess < ep["secret"] else "lower"
        return {"messages": [{"role": "user", "content": f"No, {hint}. (try {turn + 1})"}], "done": False}


@contextmanager
def serve(bug: str | None = None, name: str = "guess", token: str | None = None) -> Iterator[str]:
    attrs = {"episodes": {}, "stats": {"resets": 0, "steps": 0}, "bug": bug, "name": name, "token": token}
    handler = type("H", (Handler,), attrs)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
