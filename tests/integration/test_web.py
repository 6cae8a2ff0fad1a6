"""The shared HTTP helpers over real HTTP: a real uvicorn process built from create_app and serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from services.child_process import ROOT, running

TOKEN = "test-token-0123456789"
ENV = {"DAPO_AUTH_TOKEN": TOKEN, "DAPO_REDIS_URL": "redis://:pw-secret-xyz@127.0.0.1:1/0"}


def test_health_ready_metrics_config_and_auth(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with running("tests.integration.demo_service", env=ENV, log=log) as (base, _):
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok", "service": "demo", "detail": ""}
        for path in ("/readyz", "/metrics", "/config"):
            r = httpx.get(base + path)
            assert r.status_code == 401 and "bearer token" in r.json()["detail"]
            assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(f"{base}/hit").status_code == 401

        r = httpx.get(f"{base}/readyz", headers=auth)
        assert r.status_code == 503 and r.json()["detail"] == "needs one /hit"
        assert httpx.post(f"{base}/hit", headers=auth).json() == {"hits": 1}
        assert httpx.get(f"{base}/readyz", headers=auth).status_code == 200
        metrics = httpx.get(f"{base}/metrics", headers=auth)
        assert "dapo_demo_hits_total 1.0" in metrics.text
        assert metrics.headers["content-type"].startswith("text/plain")

        config = httpx.get(f"{base}/config", headers=auth).json()
        assert config["port"] == int(base.rsplit(":", 1)[1])  # the --port flag took effect
        assert config["auth_token"] == "**********"
        assert config["redis_url"] == "redis://:***@127.0.0.1:1/0"
    logs = log.read_text()
    assert "listening on" in logs and TOKEN not in logs and "pw-secret-xyz" not in logs


def test_bad_setting_fails_at_start_up() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tests.integration.demo_service", "--port", "70000"],
        env=os.environ | {"PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "port (env DAPO_PORT, flag --port): Input should be less than or equal to 65535" in r.stderr
