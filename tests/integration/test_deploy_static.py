"""Static checks of what cannot be built or run here: hadolint on the Dockerfiles, checkov on the rendered
Kubernetes overlays and the Dockerfiles, and checkov's secrets scan on the compose file and the GPU overlay.
Zero findings, except the checks skipped in the repository with their reasons (.hadolint.yaml,
deploy/checkov.yaml). The tools come from `make tools` (.venv-tools) or PATH; CI (DAPO_REQUIRE_TOOLS=1) fails
without them instead of skipping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from services.child_process import ROOT

DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))


def tool(name: str) -> str:
    found = ROOT / ".venv-tools" / "bin" / name
    path = str(found) if found.exists() else shutil.which(name)
    if path is None:
        if os.environ.get("DAPO_REQUIRE_TOOLS"):
            pytest.fail(f"{name} is not installed: run `make tools`")
        pytest.skip(f"{name} is not installed (make tools)")
    return path


def checkov(*args: str) -> dict:
    env = os.environ | {"BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}  # offline
    out = subprocess.run([tool("checkov"), "--config-file", str(DEPLOY / "checkov.yaml"), "--quiet", "--compact",
                          "-o", "json", *args], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    reports = json.loads(out.stdout) if out.stdout.strip().startswith(("{", "[")) else []
    reports = reports if isinstance(reports, list) else [reports]
    failed = [f"{r['check_type']}: {c['check_id']} {c['check_name']} ({c.get('resource') or c['file_path']})"
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]  # fmt: skip
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)  # --quiet lists failures only
    return {"failed": failed, "passed": passed, "stderr": out.stderr[-2000:]}


def test_hadolint_finds_nothing() -> None:
    out = subprocess.run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert len(DOCKERFILES) == 2 and out.returncode == 0, out.stdout + out.stderr
    bad = subprocess.run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "-"], input="FROM python\n",
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "DL3006" in bad.stdout  # it can fail: an untagged base image


@pytest.mark.parametrize("overlay", sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir()))
def test_checkov_passes_the_rendered_overlay(overlay: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rendered.write_text(out.stdout)
    result = checkov("-f", str(rendered), "--framework", "kubernetes")
    assert result["passed"] > 100 and result["failed"] == [], result


def test_checkov_passes_the_dockerfiles_and_finds_no_secret(tmp_path: Path) -> None:
    images = checkov("-d", str(DEPLOY / "docker"), "--framework", "dockerfile")
    assert images["passed"] > 50 and images["failed"] == [], images
    # the cpu-dev overlay's literal secrets are dev-only by design (docs: operations/deployment.md); the GPU
    # overlay and compose take theirs from the environment or a Secret
    gpu = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / "gpu")], capture_output=True,
                         text=True, timeout=120).stdout  # fmt: skip
    target = tmp_path / "gpu.yaml"
    target.write_text(gpu)
    secrets = checkov("-f", str(ROOT / "docker-compose.yml"), "-f", str(target), "--framework", "secrets")
    assert secrets["failed"] == [], secrets


def test_checkov_can_fail(tmp_path: Path) -> None:  # the checks above must be able to see a finding
    bad = tmp_path / "pod.yaml"
    bad.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
                   "    - {name: x, image: 'x:1', securityContext: {privileged: true}}\n")  # fmt: skip
    assert any("CKV_K8S_16" in f for f in checkov("-f", str(bad), "--framework", "kubernetes")["failed"])
