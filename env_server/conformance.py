"""Drive any environment server through the dapo-env/1 protocol and say what it gets wrong.

    DAPO_ENV_TOKEN=... python -m env_server.conformance http://127.0.0.1:8005 [--env calculator ...]

Exit status 0 when every check passes. What it checks (docs/services/environments.md is the protocol):
  - GET /v1/envs answers the protocol and each environment's spec; with a token, a request without it is 401;
  - per environment: a reset from a seed opens an episode; the same reset again answers the same opening, the same
    id for another seed is 409; a step out of order is 409; each step answers a StepResponse, a retried step the
    same one; the episode is done by `max_turns` (truncated if the task did not end it), and a step after is 409;
  - with tools: a malformed call (and in the `hermes` format an unknown tool) comes back as a message to the
    model, counted, the episode going on;
  - DELETE forgets the episode (a step then is 404, a second DELETE 404); unknown environment and episode 404;
    a body that does not validate 422.
The checker only speaks HTTP and reads answers with services/episodes.py: a server in any language can be checked.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.episodes import EnvList, EnvSpec, ResetResponse, StepResponse
from services.tool_calls import render_call

ANSWER = "I am not sure. Answer: 0"


@dataclass
class Report:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.passed)


class Checker:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0):
        self.base = base_url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout_s)
        self.report = Report()

    def check(self, name: str, fn: Callable[[], object]) -> bool:
        try:
            fn()
        except (AssertionError, httpx.HTTPError, ValueError) as e:
            self.report.failed.append(f"{name}: {type(e).__name__}: {e}"[:1000])
            return False
        self.report.passed.append(name)
        return True

    def _expect(self, r: httpx.Response, code: int, what: str) -> Any:
        assert r.status_code == code, f"{what}: expected {code}, got {r.status_code}: {r.text[:300]}"
        return r.json() if r.content else None

    def reset(self, env: str, seed: int, episode_id: str) -> ResetResponse:
        body = {"env": env, "seed": seed, "episode_id": episode_id}
        return ResetResponse.model_validate(self._expect(self.http.post("/v1/episodes", json=body), 200, "reset"))

    def step(self, episode_id: str, turn: int, content: str, code: int = 200) -> StepResponse | None:
        body = {"turn": turn, "message": {"role": "assistant", "content": content}}
        data = self._expect(self.http.post(f"/v1/episodes/{episode_id}/step", json=body), code, f"step {turn}")
        return StepResponse.model_validate(data) if code == 200 else None

    def run(self, only: Collection[str] = ()) -> Report:
        """Every check; the episode checks of the environments in `only` (all when empty)."""
        specs: list[EnvSpec] = []

        def listing() -> None:
            specs.extend(EnvList.model_validate(self._expect(self.http.get("/v1/envs"), 200, "GET /v1/envs")).envs)
            assert specs, "no environment is listed"

        if not self.check("GET /v1/envs lists the environments", listing):
            return self.report
        if self.token:
            self.check(
                "a request without the token is 401",
                lambda: self._expect(httpx.get(f"{self.base}/v1/envs", timeout=10), 401, "no token"),
            )
        for spec in specs:
            if not only or spec.name in only:
                self._episode_checks(spec)
        self._error_checks(specs[0])
        return self.report

    def _episode_checks(self, spec: EnvSpec) -> None:
        eid = f"conformance-{uuid.uuid4().hex[:12]}"
        opening: list[ResetResponse] = []

        def open_() -> None:
            opening.append(self.reset(spec.name, 1, eid))
            o = opening[0]
            assert o.episode_id == eid and o.env == spec.name, f"the opening names {o.episode_id!r}/{o.env!r}"
            assert o.max_turns == spec.max_turns, f"max_turns {o.max_turns} vs the listing's {spec.max_turns}"
            assert [t.function.name for t in o.tools] == [t.function.name for t in spec.tools], "tools differ"

        if not self.check(f"{spec.name}: a reset from a seed opens an episode", open_):
            return
        self.check(
            f"{spec.name}: the same reset again answers the same opening",
            lambda: self._same(self.reset(spec.name, 1, eid), opening[0]),
        )
        self.check(
            f"{spec.name}: the same id for another task is 409",
            lambda: self._expect(
                self.http.post("/v1/episodes", json={"env": spec.name, "seed": 2, "episode_id": eid}), 409, "reset"
            ),
        )
        self.check(f"{spec.name}: a step out of order is 409", lambda: self.step(eid, 2, ANSWER, code=409))
        self.check(
            f"{spec.name}: steps until done within max_turns; a retried step answers the same",
            lambda: self._play(eid, spec),
        )
        self.check(f"{spec.name}: DELETE forgets the episode", lambda: self._delete(eid))
        if spec.tool_format != "none" and spec.tools and spec.max_turns > 1:
            self.check(f"{spec.name}: bad tool calls come back to the model, counted", lambda: self._bad_tools(spec))

    def _same(self, a: ResetResponse, b: ResetResponse) -> None:
        assert a == b, "a retried reset answered another opening"

    def _play(self, eid: str, spec: EnvSpec) -> None:
        for turn in range(1, spec.max_turns + 1):
            out = self.step(eid, turn, ANSWER)
            assert out is not None and out.error is None, f"turn {turn}: the environment failed: {out and out.error}"
            assert self.step(eid, turn, ANSWER) == out, f"turn {turn}: a retried step answered something else"
            if out.done:
                assert out.reward is not None, "a finished episode has no reward"
                self.step(eid, turn + 1, ANSWER, code=409)
                return
        raise AssertionError(f"not done after max_turns = {spec.max_turns} turns")

    def _delete(self, eid: str) -> None:
        self._expect(self.http.delete(f"/v1/episodes/{eid}"), 200, "DELETE")
        self.step(eid, 1, ANSWER, code=404)
        self._expect(self.http.delete(f"/v1/episodes/{eid}"), 404, "a second DELETE")

    def _bad_tools(self, spec: EnvSpec) -> None:
        eid = f"conformance-{uuid.uuid4().hex[:12]}"
        self.reset(spec.name, 3, eid)
        if spec.tool_format == "tags":  # <name>argument</name>: an unknown tag is text, an unclosed one malformed
            name = spec.tools[0].function.name
            out = self.step(eid, 1, f"<{name}>never closed")
            assert out is not None and not out.done and out.error is None, f"a malformed call ended it: {out}"
            assert out.tools.malformed == 1 and out.messages, f"a malformed call: {out.tools}"
            self.http.delete(f"/v1/episodes/{eid}")
            return
        out = self.step(eid, 1, "<tool_call>{not json</tool_call>")
        assert out is not None and not out.done and out.error is None, f"a malformed call ended the episode: {out}"
        assert out.tools.malformed == 1 and out.messages, f"a malformed call: {out.tools}, {len(out.messages)} messages"
        out = self.step(eid, 2, render_call("no_such_tool_here", {}))
        assert out is not None and out.tools.unknown == 1 and out.messages, f"an unknown tool: {out}"
        self.http.delete(f"/v1/episodes/{eid}")

    def _error_checks(self, spec: EnvSpec) -> None:
        post = self.http.post
        self.check(
            "an unknown environment is 404",
            lambda: self._expect(post("/v1/episodes", json={"env": "no-such-env-here", "seed": 1}), 404, "reset"),
        )
        self.check("a step of an unknown episode is 404", lambda: self.step(f"nope-{uuid.uuid4().hex}", 1, "x", 404))
        self.check(
            "a reset without seed or task is 422",
            lambda: self._expect(post("/v1/episodes", json={"env": spec.name}), 422, "reset"),
        )
        eid = f"conformance-{uuid.uuid4().hex[:12]}"
        self.check("a step that is not the assistant's is 422", lambda: self._wrong_role(spec, eid))

    def _wrong_role(self, spec: EnvSpec, eid: str) -> None:
        self.reset(spec.name, 4, eid)
        body = {"turn": 1, "message": {"role": "user", "content": "hi"}}
        self._expect(self.http.post(f"/v1/episodes/{eid}/step", json=body), 422, "step")
        self.http.delete(f"/v1/episodes/{eid}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m env_server.conformance", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument(
        "--token-env",
        default="DAPO_ENV_TOKEN",
        help="The environment variable holding the server's bearer token (a token never goes on a command line); "
        "with one, the checker also checks that requests without it are 401. Default: DAPO_ENV_TOKEN.",
    )
    p.add_argument("--env", action="append", default=[], help="Only this environment's episode checks (repeatable).")
    a = p.parse_args(argv)
    report = Checker(a.url, os.environ.get(a.token_env) or None).run(a.env)
    for name in report.passed:
        print(f"pass  {name}")
    for line in report.failed:
        print(f"FAIL  {line}")
    print(f"{len(report.passed)} passed, {len(report.failed)} failed")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
