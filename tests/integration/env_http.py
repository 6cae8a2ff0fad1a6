"""A client's two calls of the dapo-env/1 protocol, asserting a 200, for the environment service's tests."""

from __future__ import annotations

import httpx

from services.episodes import ResetResponse, StepResponse


def reset(http: httpx.Client, env: str, **kw: object) -> ResetResponse:
    r = http.post("/v1/episodes", json={"env": env, **kw})
    assert r.status_code == 200, r.text
    return ResetResponse.model_validate(r.json())


def step(http: httpx.Client, eid: str, turn: int, content: str) -> StepResponse:
    r = http.post(f"/v1/episodes/{eid}/step", json={"turn": turn, "message": {"role": "assistant", "content": content}})
    assert r.status_code == 200, r.text
    return StepResponse.model_validate(r.json())
