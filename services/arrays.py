"""Packed numeric arrays for the wire contracts: token ids (int32) and log-probs (float32).

A response of 512 tokens is 512 ids and 512 log-probs; a group of 16 is 16k numbers. As Python
lists they cost more to validate and (de)serialise than Redis costs to move them (bench/queue.py).
Packed, they cross msgpack as one `bin` each, validate with one numpy call, and become a tensor
with `torch.frombuffer` in the learner without a Python loop.

    ids = TokenIds([1, 2, 3]);  len(ids) == 3;  ids.tolist() == [1, 2, 3];  ids.numpy()  # read-only
    Sample(response_token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], ...)            # lists are fine

In a model: `model_dump()` gives little-endian bytes (what the streams adapter packs);
`model_dump(mode="json")` and JSON schemas give plain lists of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema


class PackedArray:
    """An immutable 1-D array of one numeric dtype, stored little-endian."""

    dtype: ClassVar[np.dtype[Any]]
    json_item_type: ClassVar[str]
    __slots__ = ("_a",)
    _a: np.ndarray[Any, Any]

    def __init__(self, values: Any):
        if isinstance(values, bytearray | memoryview):
            values = bytes(values)
        if type(values) is bytes:  # the wire path, kept short: a read-only view, no copy
            if len(values) % self.dtype.itemsize:
                raise ValueError(f"{len(values)} bytes is not a whole number of {self.dtype.name} items")
            a = np.frombuffer(values, dtype=self.dtype)
        elif isinstance(values, PackedArray):
            a = values._a
        else:
            a = self._from_values(np.asarray(values))
            a.flags.writeable = False
        self._check(a)
        self._a = a

    def _from_values(self, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if a.ndim != 1:
            raise ValueError(f"expected a flat sequence of numbers, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iuf":
            raise ValueError(f"expected numbers, got {a.dtype} values")
        with np.errstate(over="ignore"):  # an out-of-range float becomes inf, which _check rejects
            return a.astype(self.dtype)

    def _check(self, a: np.ndarray[Any, Any]) -> None:
        """Subclasses reject values their dtype cannot hold."""

    # -- views

    def numpy(self) -> np.ndarray[Any, Any]:
        """A read-only numpy view (no copy)."""
        return self._a

    def tolist(self) -> list[Any]:
        return self._a.tolist()  # type: ignore[no-any-return]

    def tobytes(self) -> bytes:
        return self._a.tobytes()

    def __len__(self) -> int:
        return int(self._a.shape[0])

    def __iter__(self) -> Iterator[Any]:
        return iter(self._a.tolist())

    def __getitem__(self, i: int) -> Any:
        return self._a[i].item()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return type(other) is type(self) and bool(np.array_equal(self._a, other._a))
        if isinstance(other, list | tuple):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._a.tobytes()))

    def __repr__(self) -> str:
        head = self._a[:6].tolist()
        return f"{type(self).__name__}({head}{' ...' if len(self) > 6 else ''}, n={len(self)})"

    # -- pydantic

    @classmethod
    def _validate(cls, v: Any) -> PackedArray:
        return v if type(v) is cls else cls(v)

    @staticmethod
    def _serialize(v: PackedArray, info: core_schema.SerializationInfo) -> Any:
        return v.tolist() if info.mode == "json" else v.tobytes()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(cls._serialize, info_arg=True),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"type": "array", "items": {"type": cls.json_item_type}}


class TokenIds(PackedArray):
    """Token ids, int32."""

    dtype = np.dtype("<i4")
    json_item_type = "integer"
    __slots__ = ()

    def _from_values(self, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {a.dtype} values")
        if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
            raise ValueError("token ids must lie in [0, 2**31)")
        return super()._from_values(a)

    def _check(self, a: np.ndarray[Any, Any]) -> None:
        if a.size and a.min() < 0:
            raise ValueError(f"token ids must be >= 0, found {int(a.min())}")


class LogProbs(PackedArray):
    """Per-token log-probabilities, float32 (the precision the engines compute them in)."""

    dtype = np.dtype("<f4")
    json_item_type = "number"
    __slots__ = ()

    def _check(self, a: np.ndarray[Any, Any]) -> None:
        # Fast path (this runs for every sample on every hop): the sum of squares is finite only
        # if every value is finite and |x| < ~1e19, far beyond any real log-prob.
        if a.size == 0 or math.isfinite(a @ a):
            return
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"log-probs must be finite: {a[bad[0]]} at index {int(bad[0])}")
        raise ValueError(f"log-probs out of range: {float(np.abs(a).max())} (|log-prob| must be < 1e19)")
