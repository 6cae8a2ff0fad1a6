"""OpenEnv environments, run as they are: `--openenv NAME=URL` serves the OpenEnv server at URL as environment NAME.

OpenEnv (`openenv-core`, meta-pytorch/OpenEnv) serves an environment over HTTP and a WebSocket: `GET /schema`
gives the JSON Schemas of its Action and Observation, and one WebSocket connection to `/ws` is one session —
`{"type": "reset", "data": {...}}`, then `{"type": "step", "data": <action>}`, each answered by
`{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` (its plain HTTP /reset and /step
build a fresh environment per request, so an episode of several steps needs the socket). Each of our episodes is
one such session, opened at the reset and closed when the episode ends, is closed or expires.

    --openenv 'wordle=http://textarena:8000?max_turns=8'
    --openenv 'guess=http://127.0.0.1:9000?action=message&observation=feedback'

The model's whole turn is the action's text field: the Action's one required string field (or `action=`); the
Observation's text field (`observation=`, else the first string field of the schema that is not empty) is the
user turn the model reads next. The episode's reward is the sum of the step rewards (OpenEnv rewards each step;
most give one at the end). A reset task is OpenEnv's reset arguments (`{"seed": n}` from a seed). A session the
server cannot open (at capacity) is a 429 to the client, one it cannot reach a 502.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit, urlunsplit

import httpx
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect

from env_server.base import Environment, Outcome, user
from env_server.table import Busy
from services.episodes import NAME_PATTERN


class Unreachable(Exception):
    """The OpenEnv server could not be reached or answered out of protocol (the service answers 502)."""


@dataclass
class _Session:
    ws: ClientConnection
    reward: float = 0.0


class OpenEnv(Environment):
    """One OpenEnv server as an environment of the service."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        max_turns: int = 16,
        timeout_s: float = 10.0,
        action: str | None = None,
        observation: str | None = None,
    ):
        self.name = name  # type: ignore[misc]  # a class attribute for the others; per instance here
        self.max_turns = max_turns  # type: ignore[misc]
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._action, self._observation = action, observation
        self._fields: tuple[str, list[str]] | None = None
        self.description = f"OpenEnv server at {self.url}"  # type: ignore[misc]

    @classmethod
    def parse(cls, entry: str) -> OpenEnv:
        """NAME=URL[?max_turns=N&timeout_s=S&action=FIELD&observation=FIELD] -> the environment (ValueError)."""
        name, eq, url = entry.partition("=")
        if not eq or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(f"--openenv {entry!r}: write NAME=URL (NAME: {NAME_PATTERN})")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--openenv {entry!r}: the URL must be http(s)://host:port")
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = q.keys() - {"max_turns", "timeout_s", "action", "observation"}
        if unknown:
            raise ValueError(f"--openenv {entry!r}: unknown options {sorted(unknown)}")
        base = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        max_turns, timeout_s = int(q.get("max_turns", 16)), float(q.get("timeout_s", 10))
        if not (1 <= max_turns <= 1024 and 0 < timeout_s <= 3600):  # NaN fails both comparisons
            raise ValueError(f"--openenv {entry!r}: max_turns must be 1-1024 and timeout_s in (0, 3600]")
        return cls(
            name,
            base,
            max_turns=max_turns,
            timeout_s=timeout_s,
            action=q.get("action"),
            observation=q.get("observation"),
        )

    # -- the OpenEnv server's shapes, read once from GET /schema

    def fields(self) -> tuple[str, list[str]]:
        """(the action's text field, the observation's string fields in schema order); read once (two workers racing
        read it twice and keep the same answer: no lock, so a server that does not answer queues no one behind it)."""
        if self._fields is None:
            self._fields = self._read_schema()
        return self._fields

    def _read_schema(self) -> tuple[str, list[str]]:
        try:
            r = httpx.get(f"{self.url}/schema", timeout=self.timeout_s)
            r.raise_for_status()
            schema = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise Unreachable(f"OpenEnv server {self.url}: GET /schema failed: {e}") from None
        action, obs = schema.get("action") or {}, schema.get("observation") or {}
        strings = [k for k, p in (action.get("properties") or {}).items() if p.get("type") == "string"]
        required = [k for k in strings if k in (action.get("required") or [])]
        field = self._action or (required[0] if len(required) == 1 else None)
        if field is None or field not in strings:
            why = f"string fields {strings}, required {required}"
            # not worth a retry: a 500
            raise RuntimeError(
                f"OpenEnv server {self.url}: no single text field in its action for the model's turn "
                f"({why}); name one with ?action=FIELD"
            )
        texts = [k for k, p in (obs.get("properties") or {}).items() if p.get("type") == "string"]
        if self._observation is not None:
            texts = [self._observation]
        return field, texts

    def _text(self, observation: dict[str, Any]) -> str:
        for k in self.fields()[1]:
            if isinstance(observation.get(k), str) and observation[k].strip():
                return str(observation[k])
        rest = {k: v for k, v in observation.items() if v not in (None, "", [], {})}
        return json.dumps(rest, ensure_ascii=False, default=str)

    # -- one session per episode

    def _call(self, ws: ClientConnection, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        try:
            with contextlib.suppress(ConnectionClosed):  # a server at capacity says so and closes: read why below
                ws.send(json.dumps({"type": kind, "data": data}))
            reply = json.loads(ws.recv(timeout=self.timeout_s))
        except (WebSocketException, OSError, TimeoutError, ValueError) as e:
            raise Unreachable(f"OpenEnv server {self.url}: {kind} failed: {type(e).__name__}: {e}") from None
        if not isinstance(reply, dict):
            raise Unreachable(f"OpenEnv server {self.url}: {kind} answered {str(reply)[:200]}")
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            if err.get("code") == "CAPACITY_REACHED":
                raise Busy(f"OpenEnv server {self.url} is at capacity ({err.get('max_sessions')} sessions)")
            raise RuntimeError(f"OpenEnv {kind}: {err.get('code')}: {str(err.get('message'))[:500]}")
        if reply.get("type") != "observation" or not isinstance(reply.get("data"), dict):
            raise Unreachable(f"OpenEnv server {self.url}: {kind} answered {str(reply)[:200]}")
        return dict(reply["data"])

    def draw(self, seed: int) -> dict[str, Any]:
        return {"seed": seed % 2**31}

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        if not all(isinstance(k, str) for k in task):
            raise ValueError("an OpenEnv task is its reset arguments: an object")
        return json.loads(json.dumps(task))

    def start(self, task: dict[str, Any]) -> tuple[list[Any], Any]:
        self.fields()
        ws_url = urlunsplit(urlsplit(self.url)._replace(scheme="wss" if self.url.startswith("https") else "ws"))
        try:
            ws = connect(f"{ws_url}/ws", open_timeout=self.timeout_s, close_timeout=2, max_size=2**24)
        except (WebSocketException, OSError, TimeoutError) as e:
            raise Unreachable(f"OpenEnv server {self.url}: cannot open a session: {type(e).__name__}: {e}") from None
        try:
            data = self._call(ws, "reset", task)
            return [user(self._text(_obj(data.get("observation"))))], _Session(ws)
        except BaseException:
            ws.close()
            raise

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        s: _Session = state
        data = self._call(s.ws, "step", {self.fields()[0]: text})
        s.reward += float(data.get("reward") or 0.0)
        if data.get("done"):
            return Outcome(reward=s.reward, done=True, info={"openenv_reward": data.get("reward")})
        return Outcome(messages=[user(self._text(_obj(data.get("observation"))))])

    def release(self, state: Any) -> None:
        if isinstance(state, _Session):
            threading.Thread(target=_close, args=(state.ws,), daemon=True).start()  # not on the event loop

    @property
    def tool_format(self) -> Literal["hermes", "tags", "none"]:
        return "none"  # the model's whole turn is the action


def _obj(x: Any) -> dict[str, Any]:
    if x is not None and not isinstance(x, dict):
        raise Unreachable(f"an OpenEnv observation is an object, not {type(x).__name__}")
    return x or {}


def _close(ws: ClientConnection) -> None:
    try:
        ws.send(json.dumps({"type": "close"}))
    except (WebSocketException, OSError):
        pass
    ws.close()
