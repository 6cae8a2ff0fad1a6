"""Packed arrays: lists in, bytes on the wire, lists in JSON; bad values rejected with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from services.arrays import LogProbs, TokenIds


class M(BaseModel):
    ids: TokenIds
    lp: LogProbs


def test_list_in_bytes_out_and_back() -> None:
    m = M(ids=[5, 0, 49151], lp=[-0.5, -1.25, 0.0])
    dumped = m.model_dump()
    assert dumped["ids"] == np.array([5, 0, 49151], "<i4").tobytes()
    assert dumped["lp"] == np.array([-0.5, -1.25, 0.0], "<f4").tobytes()
    back = M.model_validate(dumped)
    assert back == m and back.ids == [5, 0, 49151] and back.lp.tolist() == [-0.5, -1.25, 0.0]
    assert len(back.ids) == 3 and list(back.ids) == [5, 0, 49151] and back.ids[2] == 49151


def test_json_mode_and_schema_use_plain_lists() -> None:
    m = M(ids=[1, 2], lp=[-0.5, -0.25])
    assert json.loads(m.model_dump_json()) == {"ids": [1, 2], "lp": [-0.5, -0.25]}
    assert M.model_validate_json(m.model_dump_json()) == m
    props = M.model_json_schema()["properties"]
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}, "title": "Ids"}
    assert props["lp"]["items"] == {"type": "number"}


def test_numpy_view_is_read_only() -> None:
    ids = TokenIds([1, 2, 3])
    with pytest.raises(ValueError):
        ids.numpy()[0] = 7


def test_log_probs_are_float32() -> None:
    lp = LogProbs([-0.1])
    assert lp[0] == float(np.float32(-0.1)) and lp[0] != -0.1


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([1.5, 2.0], "token ids must be integers"),
        ([-1, 2], r"token ids must lie in \[0, 2\*\*31\)"),
        ([2**31], r"token ids must lie in \[0, 2\*\*31\)"),
        ([[1, 2]], "flat sequence"),
        (b"\x00\x00\x00", "not a whole number of int32 items"),
        (np.array([-3], "<i4").tobytes(), "token ids must be >= 0"),
    ],
)
def test_bad_token_ids_rejected(value, reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        M(ids=value, lp=[0.0] * 2)


@pytest.mark.parametrize("value", [["a"], [1e300], [float("nan")], np.array([np.inf], "<f4").tobytes()])
def test_bad_log_probs_rejected(value) -> None:
    with pytest.raises(ValidationError, match="lp"):
        M(ids=[1], lp=value)


def test_equality_and_hash() -> None:
    assert TokenIds([1, 2]) == TokenIds(np.array([1, 2], np.int64))
    assert TokenIds([1, 2]) != TokenIds([1, 3])
    assert TokenIds([1]) != LogProbs([1.0])
    assert hash(TokenIds([1, 2])) == hash(TokenIds([1, 2]))
