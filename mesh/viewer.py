"""`dapo-mesh view RUN_DIR`: the episodes of a run in the browser, finished or live.

    dapo-mesh view .dapo                 # http://127.0.0.1:8090
    DAPO_AUTH_TOKEN=... dapo-mesh view .dapo --host 0.0.0.0     # then open http://HOST:8090/#token=...

It reads what the run records (nothing else is needed, the mesh need not be up): the learner's recorded groups
(learner/episodes/v<version>.jsonl: trained; dropped-v*.jsonl: stale at the update), the buffer's
(buffer/episodes/dropped-v*.jsonl: dropped by dynamic sampling and why), the held-out samples of each evaluation
(evals/v<version>.jsonl) and metrics.jsonl (the curves). `Index` keeps one small entry per sample and reads only
what a file added since it last looked (a file replaced whole is read again), so a live run's new versions appear on
the next request. An episode's tokens are decoded with the tokenizer of the model the learner names in
learner/episodes/meta.json (or --tokenizer).

The page (viewer.html) is static and holds no data; the API under /api wants the bearer token when one is set (the
page sends the one given in its address's #token=..., which a browser never sends to a server).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field

from mesh.layout import RunLayout
from services.episode_log import META, expand, read_jsonl
from services.settings import ServiceSettings
from services.web import create_app, require_token

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("viewer.html")
REFRESH_S = 1.0  # the files are looked at again at most this often
HELD_OUT = "held-out"


class ViewerSettings(ServiceSettings):
    run_dir: Path = Field(Path(".dapo"), description="The run directory of `dapo-mesh up` (finished or running).")
    port: int = Field(8090, ge=0, le=65535, description="HTTP port (0: any free port).")
    tokenizer: Path | None = Field(
        None, description="A model folder whose tokenizer decodes the tokens; unset: the one the learner recorded."
    )


@dataclass
class Entry:
    """One sample of a recorded group (or one held-out sample): what the list shows and filters on."""

    id: str  # "<file>:<byte offset of its line>:<sample>"
    version: int
    task: str
    outcome: str  # trained, dropped, held-out
    reason: str | None
    reward: float
    acc: bool
    advantage: float | None
    tokens: int
    preview: str

    def row(self) -> dict[str, Any]:
        return self.__dict__


@dataclass
class _File:
    size: int = 0
    inode: int = 0
    entries: list[Entry] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)


class Index:
    """Every recorded sample of a run directory, kept up to date by `refresh` (cheap: a stat per file)."""

    def __init__(self, run_dir: Path):
        self.layout = RunLayout(run_dir)
        self.files: dict[str, _File] = {}
        self.lock = threading.Lock()
        self.checked = 0.0

    def roots(self) -> dict[str, Path]:
        """Short names of the folders read, for ids: learner, buffer, evals."""
        learner, buffer = self.layout.episodes
        return {"learner": learner, "buffer": buffer, "evals": self.layout.evals}

    def path(self, name: str) -> Path:
        """The file of a name the index holds (no path from a client is opened as given)."""
        root, _, base = name.partition("/")
        return self.roots()[root] / base

    def refresh(self, force: bool = False) -> None:
        with self.lock:
            if not force and time.monotonic() - self.checked < REFRESH_S:
                return
            self.checked = time.monotonic()
            for root, folder in self.roots().items():
                for p in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
                    self._read(f"{root}/{p.name}", p, held_out=root == "evals")

    def _read(self, name: str, path: Path, held_out: bool) -> None:
        try:
            st = path.stat()
        except OSError:  # replaced between the glob and here: the next refresh reads it
            return
        f = self.files.get(name)
        if f is not None and f.inode == st.st_ino and f.size == st.st_size:
            return
        if f is None or f.inode != st.st_ino or st.st_size < f.size:  # new, or replaced whole: read it all again
            f = self.files[name] = _File(inode=st.st_ino)
        with path.open("rb") as fh:
            fh.seek(f.size)
            data = fh.read(st.st_size - f.size)
        offset = f.size
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):  # a line still being written: read it next time
                break
            try:
                new = _entries(name, offset, json.loads(line), held_out)
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # not a record: said, and passed over
                log.warning("%s: the line at byte %d is not a record (%s): skipped", name, offset, e)
            else:
                f.entries += new
                f.ids.update(e.id for e in new)
            offset += len(line)
        f.size = offset

    def entries(self) -> list[Entry]:
        """Every sample, a copy (requests run in threads; a refresh may be adding files meanwhile)."""
        with self.lock:
            return [e for f in self.files.values() for e in f.entries]

    def record(self, entry_id: str) -> tuple[dict[str, Any], int]:
        """(the recorded line, the sample's place in it) of an id the index holds (of the file as it is now)."""
        name, off, j = _split_id(entry_id)
        with self.lock:
            known = name in self.files and entry_id in self.files[name].ids
        if not known:
            raise HTTPException(404, f"no recorded episode {entry_id!r} in this run (reload the list)")
        with self.path(name).open("rb") as fh:
            fh.seek(off)
            line = fh.readline()
        try:
            return json.loads(line), j
        except ValueError:
            raise HTTPException(404, f"episode {entry_id!r}: the file changed; reload the list") from None


def _split_id(entry_id: str) -> tuple[str, int, int]:
    try:
        name, off, j = entry_id.rsplit(":", 2)
        return name, int(off), int(j)
    except ValueError:
        raise HTTPException(400, f"not an episode id: {entry_id!r}") from None


def _entries(name: str, offset: int, rec: dict[str, Any], held_out: bool) -> list[Entry]:
    if held_out:  # one held-out sample per line
        return [
            Entry(
                f"{name}:{offset}:0",
                rec["version"],
                rec["task"],
                HELD_OUT,
                None,
                float(rec["score"]),
                bool(rec["acc"]),
                None,
                int(rec["response_tokens"]),
                rec["response"][:120],
            )
        ]
    return [
        Entry(
            f"{name}:{offset}:{j}",
            rec["version"],
            rec["task"],
            rec["outcome"],
            rec.get("reason"),
            float(s["reward"]),
            bool(s["acc"]),
            s.get("advantage"),
            len(s["ids"]),
            s["text"][:120],
        )
        for j, s in enumerate(rec["samples"])
    ]


class Pieces:
    """Token ids -> the text of each token, from the run's tokenizer (loaded at the first episode opened)."""

    def __init__(self, layout: RunLayout, override: Path | None):
        self.layout, self.override = layout, override
        self.tok: Any = None
        self.error = ""
        self.lock = threading.Lock()

    def model_dir(self) -> Path | None:
        if self.override is not None:
            return self.override
        try:
            meta = json.loads((self.layout.episodes[0] / META).read_text())
        except (OSError, ValueError):
            return None
        return Path(meta["model_dir"]) if meta.get("model_dir") else None

    def __call__(self, ids: list[int]) -> list[str] | None:
        """Each token's text as it reads in context: the growth of the decoded prefix (a token alone loses a
        SentencePiece space, and half of a character split across byte-level tokens is "�"); None: no tokenizer."""
        with self.lock:
            if self.tok is None and not self.error:
                self._load()
            if self.tok is None:
                return None
            tok = self.tok
        out, before = [], ""
        for i in range(len(ids)):
            text = tok.decode(ids[: i + 1])
            out.append(text[len(before) :] if text.startswith(before) else tok.decode(ids[i : i + 1]))
            before = text
        return out

    def _load(self) -> None:
        """The `tokenizers` file of the model (0.2 s), else transformers' AutoTokenizer (seconds: its import)."""
        path = self.model_dir()
        if path is None or not path.exists():
            self.error = f"no tokenizer: {path or 'learner/episodes/meta.json names no model'} (use --tokenizer)"
            return
        try:
            if (path / "tokenizer.json").exists():
                from tokenizers import Tokenizer

                self.tok = _Fast(Tokenizer.from_file(str(path / "tokenizer.json")))
            else:
                from transformers import AutoTokenizer

                self.tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 (any failure to load: the page shows token ids and says why)
            self.error = f"no tokenizer in {path}: {e}"

    def warm(self) -> None:
        """Load the tokenizer now (a thread at start-up), not at the first episode opened."""
        with self.lock:
            if self.tok is None and not self.error:
                self._load()


class _Fast:
    """A `tokenizers.Tokenizer` with the one method the viewer uses, as transformers' tokenizers have it."""

    def __init__(self, tok: Any):
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))


class Page(BaseModel):
    total: int
    page: int
    size: int
    rows: list[dict[str, Any]]


def create_viewer(s: ViewerSettings) -> Any:
    registry = CollectorRegistry()
    index = Index(s.run_dir)
    pieces = Pieces(index.layout, s.tokenizer)
    threading.Thread(target=pieces.warm, name="tokenizer", daemon=True).start()
    threading.Thread(target=index.refresh, name="index", daemon=True).start()  # the first page finds it built
    app = create_app("viewer", s, registry, ready=lambda: (s.run_dir.is_dir(), str(s.run_dir)))
    api = APIRouter(prefix="/api", dependencies=[Depends(require_token)])
    app.state.index = index

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        """The page: static, no data (the API holds it, behind the token)."""
        return HTMLResponse(PAGE.read_text(), headers={"Cache-Control": "no-store"})

    @api.get("/run")
    def run() -> dict[str, Any]:
        """What the filters offer: versions, tasks, outcomes and reasons with their counts; recording bounds hit."""
        return run_summary(index, s.run_dir)

    @api.get("/metrics")
    def metrics() -> list[dict[str, Any]]:
        """metrics.jsonl's rows (the curves); NaN and infinities as null (JSON has neither)."""
        return [{k: _finite(v) for k, v in r.items()} for r in read_jsonl(index.layout.metrics)]

    @api.get("/episodes", response_model=Page)
    def episodes(
        version: Annotated[int | None, Query(ge=0)] = None,
        task: str | None = None,
        outcome: str | None = None,
        reason: str | None = None,
        correct: Literal["yes", "no"] | None = None,
        sort: Literal["version", "reward", "-reward", "tokens", "-tokens"] = "version",
        page: Annotated[int, Query(ge=0)] = 0,
        size: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> Page:
        """Samples matching every filter given, a page at a time."""
        index.refresh()
        es = [
            e
            for e in index.entries()
            if (version is None or e.version == version)
            and (task is None or e.task == task)
            and (outcome is None or e.outcome == outcome)
            and (reason is None or e.reason == reason)
            and (correct is None or e.acc == (correct == "yes"))
        ]
        key = sort.lstrip("-")
        es.sort(key=lambda e: (getattr(e, key), e.id), reverse=sort.startswith("-"))
        return Page(total=len(es), page=page, size=size, rows=[e.row() for e in es[page * size : (page + 1) * size]])

    @api.get("/episodes/{entry_id:path}")
    def episode(entry_id: str) -> dict[str, Any]:
        """One sample: its group's task, and each token with its role, policy version, behaviour log-prob, the
        learner's log-prob before the update (trained samples; where the loss mask is 1) and loss mask."""
        index.refresh()
        return episode_detail(index, pieces, entry_id)

    app.include_router(api)
    return app


def run_summary(index: Index, run_dir: Path) -> dict[str, Any]:
    index.refresh()
    es = index.entries()
    stopped = {}
    for name, folder in index.roots().items():
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError):
            continue
        if meta.get("stopped_at") is not None:
            stopped[name] = meta["stopped_at"]
    return {
        "run": run_dir.resolve().name,
        "versions": sorted({e.version for e in es}),
        "tasks": _counts(e.task for e in es),
        "outcomes": _counts(e.outcome for e in es),
        "reasons": _counts(e.reason for e in es if e.reason),
        "samples": len(es),
        "recording_stopped_at": stopped,
    }


def episode_detail(index: Index, pieces: Pieces, entry_id: str) -> dict[str, Any]:
    rec, j = index.record(entry_id)
    if "samples" not in rec:  # a held-out sample: text only
        return {"id": entry_id, "outcome": HELD_OUT, **rec, "tokens": None}
    if not 0 <= j < len(rec["samples"]):
        raise HTTPException(404, f"episode {entry_id!r}: its group has {len(rec['samples'])} samples")
    s = rec["samples"][j]
    group = {k: v for k, v in rec.items() if k != "samples"}
    n = len(s["ids"])
    text = pieces(s["ids"])
    roles = expand(s.get("turns"), n, "model")
    versions = expand(s["versions"], n, rec["version"])
    mask = expand(s["mask"], n, 1)
    learner = s.get("learner_logp")
    tokens = [
        {
            "t": text[i] if text is not None else f"<{s['ids'][i]}>",
            "id": s["ids"][i],
            "role": roles[i],
            "v": versions[i],
            "lp": s["logp"][i],
            "llp": learner[i] if learner is not None and mask[i] else None,
            "m": mask[i],
        }
        for i in range(n)
    ]
    sample = {k: v for k, v in s.items() if k not in ("ids", "logp", "learner_logp", "versions", "mask")}
    return {"id": entry_id, **group, **sample, "tokens": tokens, "tokenizer_error": pieces.error or None}


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _counts(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def main(s: ViewerSettings) -> None:
    from services.web import serve

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    serve(create_viewer(s), s)
