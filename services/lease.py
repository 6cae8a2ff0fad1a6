"""A lease in Redis: which of several processes may write a shared state, with a fencing token for the writes.

    lease = Lease(client, "dapo:buffer:lease", holder="buffer-0", ttl_ms=10_000)
    if lease.acquire():                      # SET NX PX: one holder at a time; the others stand by
        while lease.renew():                 # PEXPIRE while the value is still ours (rate-limited)
            ...                              # every write checks the token in the same server-side step
    lease.release()                          # DEL if still ours: a successor need not wait for the TTL

A lease alone does not make a paused process safe: one stopped past the TTL (SIGSTOP, a long GC, a network
partition) wakes up believing it still holds it. So the token (`holder:random`, new per acquisition) is also
the fence: each write the holder makes checks, in the same Lua script or WATCH/MULTI/EXEC as the write, that
the key still holds its token, and a write whose token is gone raises `Fenced` and changes nothing (Kleppmann,
"How to do distributed locking", 2016). Single Redis node: the check and the write are one atomic step.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from services.streams import Fenced, redis_errors

log = logging.getLogger(__name__)

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    def __init__(self, client: redis.Redis, key: str, *, holder: str, ttl_ms: int):
        self.client, self.key, self.holder, self.ttl_ms = client, key, holder, ttl_ms
        self.token = ""  # set by a successful acquire(); '' while not held
        self._next_renew = 0.0
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    @property
    def held(self) -> bool:
        return bool(self.token)

    def acquire(self) -> bool:
        """Take the lease if nobody holds it; True if it is ours now (a new token each time)."""
        token = f"{self.holder}:{uuid.uuid4().hex[:12]}"
        with redis_errors(self.client):
            if not self.client.set(self.key, token, nx=True, px=self.ttl_ms):
                return False
        self.token = token
        self._renewed()
        log.info("took the lease %s as %s", self.key, token)
        return True

    def renew(self, *, now: bool = False) -> bool:
        """Extend the lease (at most every third of the TTL, unless `now`); False, and not held any more, if it was
        lost."""
        if not self.token:
            return False
        if not now and time.monotonic() < self._next_renew:
            return True
        with redis_errors(self.client):
            ok = bool(self._renew(keys=[self.key], args=[self.token, self.ttl_ms]))
        if not ok:
            log.warning("lost the lease %s (held as %s): another process took it after the TTL", self.key, self.token)
            self.token = ""
            return False
        self._renewed()
        return True

    def _renewed(self) -> None:
        self._next_renew = time.monotonic() + self.ttl_ms / 3000  # renewed again after a third of the TTL

    def release(self) -> None:
        """Give the lease up if it is still ours (a clean stop: the next holder need not wait for the TTL)."""
        if self.token:
            with redis_errors(self.client):
                self._release(keys=[self.key], args=[self.token])
            self.token = ""

    def pipeline(self) -> redis.client.Pipeline:
        """A MULTI/EXEC pipeline fenced by this lease: WATCH the key, check it holds our token, then MULTI; run it
        with `execute`, which raises Fenced if another process took the lease in between."""
        pipe = self.client.pipeline(transaction=True)
        try:
            with redis_errors(self.client):
                pipe.watch(self.key)
                mine = bool(self.token) and pipe.get(self.key) == self.token.encode()
        except redis.WatchError as e:  # redis-py: the connection broke while watching (no retry)
            pipe.reset()
            raise Fenced(f"the connection broke while watching {self.key}: stand down and read the state again") from e
        if not mine:
            pipe.reset()
            raise Fenced(f"{self.key} no longer holds {self.token or 'our token'}")
        pipe.multi()
        return pipe

    def execute(self, pipe: redis.client.Pipeline) -> list[object]:
        """Run a pipeline from `pipeline()`. Fenced if the lease changed since, or if the connection broke (redis-py
        reports both as WatchError): whether EXEC ran is then unknown, so the holder stands down and reads Redis
        again (the tasks and the cursor went together, or neither did)."""
        try:
            with redis_errors(self.client):
                return pipe.execute()
        except redis.WatchError as e:
            raise Fenced(f"{self.key} changed, or the connection broke, while a fenced transaction ran: {e}") from e
        finally:
            pipe.reset()

    def current_holder(self) -> str | None:
        with redis_errors(self.client):
            raw = self.client.get(self.key)
        return raw.decode() if isinstance(raw, bytes) else raw
