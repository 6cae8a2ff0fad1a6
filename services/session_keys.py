"""Gateway session ids and keys: the contract between a replica's gateway (rollout/gateway/) and the router in
front of the replicas (router/).

    tag = replica_tag("rollout-2", incarnation)  # 8 hex: the replica process (a restarted replica has a new one)
    sid = new_session_id(tag)                    # the tag + 12 random hex
    key = session_key(sid, secret)               # "dms_<sid>_<secret>": the session's API key
    parse_key(key)                               # (sid, secret), or None for anything that is not a session key
    tag_of(sid) == tag                           # the router sends a session's calls to the replica of its tag

A session id begins with its replica's tag (a hash of the replica id and its process's incarnation, both in its
heartbeat), so any router finds a session's replica from its key or its id alone, with no table to share or lose:
routers are stateless, a restarted router routes every open session, and a session whose replica has left — or
restarted, losing its sessions — is known to be gone (no live replica has its tag).
"""

from __future__ import annotations

import hashlib
import re
import uuid

KEY_PREFIX = "dms"
TAG_LEN = 8
_SID = re.compile(r"^[0-9a-f]{20}$")


def replica_tag(replica_id: str, incarnation: str) -> str:
    """8 hex characters naming a replica's process (a hash of its id and incarnation): the start of every session
    id it gives."""
    return hashlib.blake2b(f"{replica_id}/{incarnation}".encode(), digest_size=TAG_LEN // 2).hexdigest()


def new_session_id(tag: str) -> str:
    return tag + uuid.uuid4().hex[:12]


def session_key(sid: str, secret: str) -> str:
    return f"{KEY_PREFIX}_{sid}_{secret}"


def parse_key(key: str) -> tuple[str, str] | None:
    """(session id, secret) of a session key; None for anything else (a mesh token, a typo)."""
    prefix, _, rest = key.partition("_")
    sid, _, secret = rest.partition("_")
    if prefix != KEY_PREFIX or not secret or not _SID.match(sid):
        return None
    return sid, secret


def tag_of(sid: str) -> str | None:
    """The replica tag a session id begins with; None when it is not a session id."""
    return sid[:TAG_LEN] if _SID.match(sid) else None
