"""The learner's ledger, `trained.jsonl` in the learner's run directory: one `LedgerEntry` per batch trained
into the weights, appended by the learner after the update (a batch trained again after a crash appears twice,
with another pid). The mesh's run recorder turns it into metrics.jsonl, the audit accounts for every task id in
it, the benchmarks count its tokens.

    with open_ledger(learner_dir) as ledger:   # the learner
        append(ledger, entry)
    entries = read_ledger(learner_dir)          # anyone else: the whole file
    tail = LedgerTail(learner_dir); tail.read() # or only the lines added since the last read
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from services.schemas import LedgerEntry

LEDGER_FILE = "trained.jsonl"


def ledger_path(learner_dir: Path) -> Path:
    """The one place that names the ledger: where a learner whose run directory is `learner_dir` writes it."""
    return learner_dir / LEDGER_FILE


def open_ledger(learner_dir: Path) -> IO[str]:
    return open(ledger_path(learner_dir), "a")


def append(ledger: IO[str], entry: LedgerEntry) -> None:
    """One line, flushed: a reader never waits for the learner's buffer. NaN stays NaN (json, not pydantic's
    serializer, which would write null)."""
    ledger.write(json.dumps(entry.model_dump()) + "\n")
    ledger.flush()


def parse(line: str, where: str = "") -> LedgerEntry:
    try:
        return LedgerEntry.model_validate(json.loads(line))
    except ValueError as e:
        raise ValueError(f"{where}: not a ledger entry: {e}") from None


def read_ledger(learner_dir: Path) -> list[LedgerEntry]:
    """Every entry, in training order; none when the learner has not trained yet."""
    path = ledger_path(learner_dir)
    if not path.exists():
        return []
    return [parse(line, f"{path}:{n}") for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


class LedgerTail:
    """The entries added since the last `read()`: reads only the new bytes, and only whole lines (a line the
    learner is writing right now is read next time)."""

    def __init__(self, learner_dir: Path):
        self.path = ledger_path(learner_dir)
        self.offset = 0

    def read(self) -> list[LedgerEntry]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        return [parse(line, str(self.path)) for line in whole.decode().splitlines() if line.strip()]
