"""An OpenEnv environment written as an OpenEnv user writes one (openenv-core 0.3.0), served by OpenEnv's own app:
guess a number from 1 to 10, told "higher" or "lower" after each wrong guess. Run by tests/integration/test_openenv.py
in the OpenEnv venv (`make` builds .venv-openenv), never imported by the mesh:

    .venv-openenv/bin/python tests/integration/openenv_guess.py --port 8123 [--sessions 2]
"""

from __future__ import annotations

import argparse
import random
import re
import time
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""
    feedback: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> GuessObservation:
        time.sleep(float(kw.get("delay", 0)))  # a slow reset, for the tests of time limits
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, 10)
        return GuessObservation(prompt="Guess my number from 1 to 10. Answer with the number only.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            return GuessObservation(feedback="Right.", reward=1.0, done=True)
        hint = "not a number" if guess is None else "higher" if guess < self.secret else "lower"
        return GuessObservation(feedback=f"No: {hint}.", reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sessions", type=int, default=2)
    args = ap.parse_args()
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=args.sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
