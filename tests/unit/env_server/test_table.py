"""The environment service's table of episodes (env_server/table.py): a close that races a reset of the same id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from env_server.base import user
from env_server.builtins import BUILTIN
from env_server.metrics import EnvMetrics
from env_server.settings import EnvSettings
from env_server.table import Episode, EpisodeTable
from services.episodes import ResetResponse

ENV = BUILTIN[0]()


def closed(t: EpisodeTable) -> float:
    return t.metrics.episodes.labels(ENV.name, "closed")._value.get()


def table() -> EpisodeTable:
    return EpisodeTable(EnvSettings(), EnvMetrics(CollectorRegistry()))


def episode(t: EpisodeTable, eid: str) -> Episode:
    opening = ResetResponse(episode_id=eid, env=ENV.name, task_id="x", messages=[user("Hi")], tools=[], max_turns=1)
    return Episode(eid, ENV, "key", opening, state=None)


def test_a_close_while_the_reset_runs_lets_the_episode_go_when_it_ends() -> None:
    t = table()
    t.begin_opening("a")
    assert t.full() is False and t.opening == 1
    assert t.close("a")  # 200: the client gave up on the answer
    assert t.end_opening(ENV, "a") is True  # the reset is not to keep it
    assert t.opening == 0 and not t.opening_ids and not t.cancelled and closed(t) == 1
    t.begin_opening("a")  # the id is free again afterwards
    assert t.end_opening(ENV, "a") is False


def test_a_close_of_an_opened_episode_also_stops_a_retried_reset_still_running() -> None:
    """The first try opened it, the client's retry of the same id is still running when the client, having got no
    answer to either, closes it: the retry must not add it back."""
    t = table()
    t.begin_opening("a")
    t.begin_opening("a")  # the retry
    assert t.end_opening(ENV, "a") is False
    t.add(episode(t, "a"))
    assert t.close("a") and "a" not in t.episodes and closed(t) == 1  # counted at the close
    assert t.end_opening(ENV, "a") is True and closed(t) == 1  # ... once


def test_closing_what_is_neither_open_nor_opening_is_a_404() -> None:
    t = table()
    assert t.close("nobody") is False
