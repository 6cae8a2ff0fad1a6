"""Fuzzing the message decoders (what every consumer runs on bytes from the network): whatever the
bytes, `decode` returns a valid message or raises DecodeError — never another exception, never hangs.
12,000 generated inputs in all (hypothesis), across every wire type."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.schemas import MESSAGE_TYPES
from services.selfcheck import example_messages
from services.streams import DecodeError, decode, encode

TYPES = sorted(MESSAGE_TYPES)
FUZZ = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
CALLS = {"n": 0}

# msgpack values of any shape, including maps with odd keys and deep nesting
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=40), st.binary(max_size=64))  # fmt: skip
key = st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63 - 1))
value = st.recursive(leaf, lambda x: st.one_of(st.lists(x, max_size=6), st.dictionaries(key, x, max_size=6)),
                     max_leaves=30)  # fmt: skip


def check(fields: dict[bytes, bytes], name: str) -> None:
    CALLS["n"] += 1
    try:
        msg = decode(fields, MESSAGE_TYPES[name], max_bytes=1 << 16)
    except DecodeError as e:
        assert e.kind in {"malformed", "wrong_type", "too_large", "not_msgpack", "schema_version", "invalid"}
        return
    assert type(msg).__name__ == name  # it decoded: then it is a valid message of the asked type


@FUZZ
@given(name=st.sampled_from(TYPES), data=st.binary(max_size=512))
def test_random_bytes(name: str, data: bytes) -> None:
    check({b"type": name.encode(), b"data": data}, name)


@pytest.mark.slow
@FUZZ
@given(name=st.sampled_from(TYPES), body=value)
def test_random_msgpack_values(name: str, body: object) -> None:
    check({b"type": name.encode(), b"data": msgpack.packb(body)}, name)


@FUZZ
@given(msg=st.sampled_from(example_messages()), data=st.data())
def test_mutated_real_messages(msg: object, data: st.DataObject) -> None:
    """Real messages with one field replaced by anything, or their bytes flipped or cut."""
    fields = encode(msg)  # type: ignore[arg-type]
    name = type(msg).__name__
    body = msgpack.unpackb(fields[b"data"])
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(value)
    check({b"type": fields[b"type"], b"data": msgpack.packb(body)}, name)
    raw = bytearray(fields[b"data"])
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    check({b"type": fields[b"type"], b"data": bytes(raw[: data.draw(st.integers(0, len(raw)))])}, name)


@FUZZ
@given(fields=st.dictionaries(st.binary(max_size=8), st.binary(max_size=64), max_size=4),
       name=st.sampled_from(TYPES))  # fmt: skip
def test_random_fields(fields: dict[bytes, bytes], name: str) -> None:
    check(fields, name)


def test_zz_count() -> None:  # runs after the fuzzers above (file order): they really ran
    assert CALLS["n"] >= 12_000, CALLS
