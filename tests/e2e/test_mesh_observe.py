"""A run as its users look at it: one tiny mesh on environment episodes (`dapo-mesh up --tiny`) logging to the three
experiment trackers and recording its episodes; then what a user opens — the W&B offline run read back by `wandb`,
the MLflow run through `mlflow`'s client, the TensorBoard events through its reader, each equal to metrics.jsonl —
and `dapo-mesh view` driven in a real browser (Playwright's Chromium)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mesh.layout import RunLayout
from services.child_process import ROOT
from services.redis_server import free_port
from tests.e2e.meshrun import ENV, left_behind, start_mesh

CHROMIUM = os.environ.get("DAPO_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny mesh on env:retry (model and environment turns), held-out evaluations at versions 0, 2, 4, every
    tracker on with a table every 2 versions."""
    tmp = tmp_path_factory.mktemp("observe")
    flags = ["--steps", str(STEPS), "--eval-every", "2", "--set", 'mesh.dataset="env:retry"']
    flags += ["--set", "rollout.max_episode_tokens=200", "--set", 'mesh.trackers=["wandb","mlflow","tensorboard"]']
    flags += ["--set", "tracking.table_every=2"]
    wandb_home = {"WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}
    mesh = start_mesh(tmp, *flags, env={"WANDB_SILENT": "true"} | wandb_home)
    try:
        code = mesh.wait(900)
    finally:
        if mesh.poll() is None:
            mesh.kill()
    out = (tmp / "up.out").read_text()
    assert code == 0, out[-4000:]
    assert "trackers: wandb, mlflow, tensorboard" in out
    yield tmp / "run"
    time.sleep(1)
    assert left_behind(tmp / "run") == []  # wandb's service process included


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in RunLayout(run_dir).metrics.read_text().splitlines() if x.strip()]


def expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every finite number of metrics.jsonl by key and step: what each tracker must hold."""
    out: dict[str, dict[int, float]] = {}
    for r in metric_rows(run_dir):
        for k, v in r.items():
            if k not in ("kind", "step") and isinstance(v, int | float) and not isinstance(v, bool):
                if math.isfinite(v):
                    out.setdefault(k, {})[r["step"]] = float(v)
    return out


@pytest.mark.slow
def test_the_run_records_its_episodes_and_held_out_samples(run: Path) -> None:
    layout = RunLayout(run)
    learner, _ = layout.episodes
    trained = sorted(p.name for p in learner.glob("v*.jsonl"))
    assert trained == [f"v{v:06d}.jsonl" for v in range(1, STEPS + 1)]  # every version's batch, recorded once
    for v in range(1, STEPS + 1):
        groups = [json.loads(x) for x in (learner / f"v{v:06d}.jsonl").read_text().splitlines()]
        ledger = [json.loads(x) for x in layout.ledger.read_text().splitlines()]
        assert sorted(g["group_id"] for g in groups) == sorted(next(e for e in ledger if e["version"] == v)["task_ids"])
        for g in groups:
            for s in g["samples"]:
                n = len(s["ids"])
                assert len(s["logp"]) == len(s["learner_logp"]) == n
                assert sum(k for _, k in s["mask"]) == n and sum(k for _, k in s["turns"] or [["model", n]]) == n
                assert any(role == "env" for role, _ in s["turns"])  # env:retry: the environment answered
    evals = sorted(p.name for p in layout.evals.glob("v*.jsonl"))
    assert evals == ["v000000.jsonl", "v000002.jsonl", "v000004.jsonl"]
    rows = [json.loads(x) for x in (layout.evals / "v000004.jsonl").read_text().splitlines()]
    meta = next(r for r in metric_rows(run) if r["kind"] == "eval" and r["policy_version"] == 4)
    assert len(rows) == meta["eval_prompts"] * meta["eval_k"]  # every held-out sample of the evaluation
    assert sum(r["acc"] for r in rows) / len(rows) == pytest.approx(meta["eval_acc"])


def tracked(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every number of metrics.jsonl by (key, step), as the trackers are given them."""
    from mesh.trackers import metrics_of

    return {(k, r["step"]): v for r in metric_rows(run_dir) for k, v in metrics_of(r).items()}


def table_of(run_dir: Path, version: int) -> list[list[Any]]:
    """The episode table the trackers get at `version`: the first recorded samples trained into it."""
    groups = [
        json.loads(x) for x in (RunLayout(run_dir).episodes[0] / f"v{version:06d}.jsonl").read_text().splitlines()
    ]
    rows = [
        [version, g["task"], g["prompt"], s["text"], s["reward"], s["acc"], s["advantage"]]
        for g in groups
        for s in g["samples"]
    ]
    return rows[:16]


@pytest.mark.slow
def test_each_tracker_holds_every_metric_of_the_run_and_its_episode_tables(run: Path) -> None:
    from mesh.recorder import TABLE_COLUMNS
    from mesh.trackers import markdown_table, mlflow_key
    from tests.integration.test_trackers import read_mlflow, read_tensorboard, read_wandb

    want = tracked(run)
    assert any(k.startswith("eval_acc") for k, _ in want) and any(k == "reward_mean" for k, _ in want)
    trackers = run / "trackers"
    points, config, table = read_wandb(trackers / "wandb")
    assert points == want
    assert config["steps"] == STEPS and config["dataset"] == "env:retry" and config["learner"]["clip_high"] > 0
    assert table == {"columns": TABLE_COLUMNS, "data": table_of(run, STEPS)}  # the newest table (version 4)
    points, params, table = read_mlflow(trackers / "mlruns", table_version=2)
    assert points == {(mlflow_key(k), s): v for (k, s), v in want.items()}
    assert params["steps"] == str(STEPS) and params["dataset"] == "env:retry"
    assert table == {"columns": TABLE_COLUMNS, "data": table_of(run, 2)}
    [logdir] = (trackers / "tensorboard" / "dapo-mesh").iterdir()
    points, texts = read_tensorboard(logdir)
    assert points == {key: float(np.float32(v)) for key, v in want.items()}  # float32 in event files
    assert texts["episodes"] == [(v, markdown_table(TABLE_COLUMNS, table_of(run, v))) for v in (2, 4)]


@pytest.fixture(scope="module")
def viewer(run: Path) -> Iterator[str]:
    """`dapo-mesh view RUN` as a process (real uvicorn), with a bearer token."""
    port = free_port()
    env = ENV | {"DAPO_AUTH_TOKEN": "viewer-secret"}
    log = (run.parent / "view.out").open("w")
    cmd = [sys.executable, "-m", "mesh", "view", str(run), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError((run.parent / "view.out").read_text())
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_the_viewer_api_wants_the_token_and_pages_every_sample(viewer: str) -> None:
    assert httpx.get(f"{viewer}/api/run", timeout=5).status_code == 401
    auth = {"Authorization": "Bearer viewer-secret"}
    run = httpx.get(f"{viewer}/api/run", headers=auth, timeout=5).json()
    assert set(run["outcomes"]) >= {"trained", "held-out"}
    seen = []
    for n in range(100):
        page = httpx.get(f"{viewer}/api/episodes", params={"size": 50, "page": n}, headers=auth, timeout=5).json()
        assert page["total"] == run["samples"]
        seen += [r["id"] for r in page["rows"]]
        if len(page["rows"]) < 50:
            break
    assert len(seen) == len(set(seen)) == run["samples"]  # the pages hold every sample once (timings: bench)
    bad = httpx.get(f"{viewer}/api/episodes/..%2F..%2Fetc%2Fpasswd:0:0", headers=auth, timeout=5)
    assert bad.status_code == 404 and "no recorded episode" in bad.text


@pytest.mark.slow
@pytest.mark.skipif(  # CI (DAPO_REQUIRE_TOOLS=1) fails instead: .ci/run installs Debian's chromium
    CHROMIUM is None and not os.environ.get("DAPO_REQUIRE_TOOLS"), reason="no Chromium (apt install chromium)"
)
def test_the_viewer_in_a_real_browser(viewer: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{viewer}/#token=viewer-secret")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            rows = page.locator("#list tbody tr")
            assert rows.count() > 0

            every = (
                "([k, v]) => { const rs = [...document.querySelectorAll('#list tbody tr')]; "
                "return rs.length > 0 && rs.every(r => r.dataset[k] === v); }"
            )
            outcomes = set(rows.evaluate_all("rs => rs.map(r => r.dataset.outcome)"))
            assert len(outcomes) > 1  # the first page, unfiltered, holds more than one outcome
            for outcome in ("held-out", "trained"):
                page.select_option("#outcome", outcome)
                page.wait_for_function(every, arg=["outcome", outcome])

            tasks = page.locator("#task option").evaluate_all("os => os.map(o => o.value).filter(v => v)")
            assert tasks
            page.select_option("#task", tasks[0])
            page.wait_for_function(every, arg=["task", tasks[0]])

            rows.first.click()
            page.wait_for_selector("#tokens .turn.env")
            assert page.locator("#tokens .turn.model").count() >= 1
            assert page.locator("#tokens .turn.env .tok.model").count() == 0  # the environment's tokens apart
            assert page.locator("#tokens .turn.model .tok.env").count() == 0
            env_tok = page.locator("#tokens .tok.env").first
            assert "masked" in (env_tok.get_attribute("class") or "")  # not in the loss

            page.select_option("#colour", "mask")
            colours = page.evaluate(
                "() => [...document.querySelectorAll('#tokens .tok')].map(t => [t.classList.contains('env'), "
                "getComputedStyle(t).backgroundColor])"
            )
            assert {c for env, c in colours if env} == {"rgb(238, 238, 238)"}  # grey: out of the loss
            page.select_option("#colour", "version")
            by_version = page.evaluate(
                "() => [...document.querySelectorAll('#tokens .tok')].map(t => [t.dataset.v, "
                "getComputedStyle(t).backgroundColor])"
            )
            colour_of: dict[str, set[str]] = {}
            for v, c in by_version:
                colour_of.setdefault(v, set()).add(c)
            assert all(len(c) == 1 for c in colour_of.values())  # one colour per policy version
            assert len({next(iter(c)) for c in colour_of.values()}) == len(colour_of)  # and one version per colour
            assert "rgb(238, 238, 238)" not in {c for _, c in by_version}
            page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)

            page.select_option("#task", "")
            page.locator("#curve circle[data-series='eval_acc'][data-version='2']").click()
            expect(page.locator("#version")).to_have_value("2")
            expect(page.locator("#outcome")).to_have_value("held-out")
            page.wait_for_function(every, arg=["outcome", "held-out"])
            page.wait_for_function(every, arg=["version", "2"])
        finally:
            browser.close()
