"""The file contracts between processes: the learner's ledger (trained.jsonl) and the held-out items
(eval.jsonl) are read back exactly as written, a reader following the ledger sees whole lines only, and a
line that is not a contract is an error naming the file and line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from services import ledger
from services.datasets import Item, eval_items_path, read_items, write_items
from services.schemas import LedgerEntry


def entry(batch_id: int, version: int, **metrics: float) -> LedgerEntry:
    return LedgerEntry(batch_id=batch_id, version=version, pid=42, lag=1, task_ids=[f"t{batch_id}a", f"t{batch_id}b"],
                       metrics={"loss": 0.5, "response_tokens": 17, **metrics})  # fmt: skip


def test_ledger_round_trip_keeps_types_and_nan(tmp_path: Path) -> None:
    with ledger.open_ledger(tmp_path) as f:
        ledger.append(f, entry(0, 1, entropy=math.nan))
        ledger.append(f, entry(1, 2))
    assert ledger.ledger_path(tmp_path) == tmp_path / "trained.jsonl"
    back = ledger.read_ledger(tmp_path)
    assert [e.batch_id for e in back] == [0, 1] and back[1] == entry(1, 2)
    assert math.isnan(back[0].metrics["entropy"])  # not null: NaN means "not known"
    assert isinstance(back[0].metrics["response_tokens"], int)  # a count stays an int
    assert ledger.read_ledger(tmp_path / "none") == []


def test_tail_reads_only_new_whole_lines(tmp_path: Path) -> None:
    tail = ledger.LedgerTail(tmp_path)
    assert tail.read() == []  # no file yet
    path = ledger.ledger_path(tmp_path)
    first = entry(0, 1).model_dump_json() + "\n"
    second = entry(1, 2).model_dump_json() + "\n"
    path.write_text(first + second[:20])  # the learner is half-way through the second line
    assert [e.version for e in tail.read()] == [1]
    assert tail.read() == []
    path.write_text(first + second)
    assert [e.version for e in tail.read()] == [2]


def test_a_bad_ledger_line_names_its_place(tmp_path: Path) -> None:
    ledger.ledger_path(tmp_path).write_text(entry(0, 1).model_dump_json() + "\n" + '{"batch_id": 1}\n')
    with pytest.raises(ValueError, match=r"trained.jsonl:2: not a ledger entry"):
        ledger.read_ledger(tmp_path)
    with pytest.raises(ValidationError, match="version"):
        LedgerEntry(batch_id=0, version=0, pid=1, lag=0, task_ids=[])  # version 0 has trained nothing


def test_held_out_items_round_trip(tmp_path: Path) -> None:
    items = [Item(f"p{i}", f"What is {i} + 1?", str(i + 1), "reasoning_gym:basic_arithmetic", "rg") for i in range(3)]
    path = eval_items_path(tmp_path)
    write_items(path, items)
    assert path == tmp_path / "eval.jsonl" and read_items(path) == items
    path.write_text(path.read_text() + '{"prompt_id": "x"}\n')
    with pytest.raises(ValueError, match=r"eval.jsonl:4: not an item \(prompt_id, prompt, ground_truth"):
        read_items(path)
