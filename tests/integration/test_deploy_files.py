"""What cannot run here is validated offline: the compose file (compose-spec), every kustomize overlay
(`kubectl kustomize` + kubernetes-validate --strict; KEDA and Prometheus-Operator kinds against their
own schemas below), Prometheus config and rules (promtool), and the Grafana dashboard (parses, and
references only metrics the code exports)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.common.launch import ROOT

DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
# a machine without the tool skips; CI (DAPO_REQUIRE_TOOLS=1) fails instead
needs = {tool: pytest.mark.skipif(shutil.which(tool) is None and not os.environ.get("DAPO_REQUIRE_TOOLS"),
                                  reason=f"{tool} is not installed") for tool in ("kubectl", "promtool")}  # fmt: skip


# ---------------------------------------------------------------------------------------- metrics


def exported_metrics() -> set[str]:
    """Every sample name the services can export (counters as *_total, histograms as *_bucket/_sum/_count)."""
    from learner.metrics import LearnerMetrics
    from learner.weight_sync import SyncMetrics
    from reward_server.scoring import RewardMetrics
    from rollout.metrics import RolloutMetrics
    from services.buffer.metrics import BufferMetrics
    from services.common.streams import StreamMetrics

    registry = CollectorRegistry()
    for cls in (LearnerMetrics, SyncMetrics, RewardMetrics, RolloutMetrics, BufferMetrics, StreamMetrics):
        cls(registry)
    names = set()
    for family in registry.collect():
        kind = family.type
        base = family.name
        names |= {base}
        if kind == "counter":
            names |= {f"{base}_total"}
        if kind == "histogram":
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\bdapo_[a-z0-9_]+\b", text)) - {"dapo_auth_token"}


def test_dashboard_and_alerts_use_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "dapo-mesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 30 and dashboard["uid"] == "dapo-mesh"
    rules = (DEPLOY / "prometheus" / "rules.yml").read_text()
    known = exported_metrics()
    for where, text in (("dashboard", "\n".join(exprs)), ("rules.yml", rules)):
        unknown = referenced(text) - known
        assert not unknown, f"{where} references metrics no service exports: {sorted(unknown)}"
    # the dashboard covers the mesh end to end: every service's metrics appear
    prefixes = ("dapo_reward_", "dapo_buffer_", "dapo_rollout_", "dapo_learner_", "dapo_learner_sync_", "dapo_eval_")
    for prefix in prefixes:
        assert any(m.startswith(prefix) for m in referenced("\n".join(exprs))), prefix


def test_referenced_finds_names() -> None:  # the check above must be able to fail
    assert referenced("rate(dapo_nope_total[5m]) / dapo_buffer_keep_ratio") - exported_metrics() == {"dapo_nope_total"}


# ---------------------------------------------------------------------------------------- compose


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # resolves the YAML merge keys


def test_compose_file_is_valid_compose_spec() -> None:
    import compose_spec

    compose_spec.PyCompose.from_json(json.dumps(compose())).validate()  # raises on any schema error
    bad = compose()
    bad["services"]["learner"]["depends_on"]["redis"]["condition"] = "service_up"
    with pytest.raises(ValueError, match="service_up"):
        compose_spec.PyCompose.from_json(json.dumps(bad)).validate()


def test_compose_references_and_health() -> None:
    c = compose()
    services, volumes, secrets = c["services"], set(c["volumes"]), set(c["secrets"])
    expected = {"redis", "reward-server", "buffer", "rollout", "learner", "prometheus", "grafana"}
    assert expected <= set(services)
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, but it has no check"
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            assert src.startswith(".") or src in volumes, f"{name}: volume {src} is not declared"
        assert set(svc.get("secrets", [])) <= secrets
        if name not in ("prepare-model",):
            assert "healthcheck" in svc or "depends_on" in svc, f"{name} has neither a healthcheck nor dependencies"
    assert "--appendonly" in " ".join(services["redis"]["command"])
    rollout = services["rollout"]
    assert "container_name" not in rollout and "ports" not in rollout  # `--scale rollout=N` needs both absent
    gpu = services["rollout-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    for svc in ("reward-server", "buffer", "learner", "rollout"):
        env = services[svc]["environment"]
        assert env["DAPO_AUTH_TOKEN"].startswith("${DAPO_AUTH_TOKEN:?"), "the token must be required, not defaulted"
    for f in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / f).read_text()
        assert '"torch==2.13.0"' in text and "USER 10001" in text


# ---------------------------------------------------------------------------------------- kubernetes

# The custom resources kubernetes-validate has no schema for, checked against the parts of their CRDs
# (KEDA 2.x, Prometheus Operator) that we use: unknown fields are errors, as with --strict.
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "keda.sh/v1alpha1/ScaledObject": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"]},
                "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"}, "pollingInterval": {"type": "integer"},
                "advanced": {"type": "object"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"type": "string"}, "metadata": {
                        "type": "object", "additionalProperties": {"type": "string"}},
                        "authenticationRef": {"type": "object", "required": ["name"]}}}},
            }}},
    },
    "keda.sh/v1alpha1/TriggerAuthentication": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "additionalProperties": False, "properties": {
            "secretTargetRef": {"type": "array", "items": {
                "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}}}}},
    },
    "monitoring.coreos.com/v1/PodMonitor": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {
            "type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
            "properties": {"selector": {"type": "object"}, "podMetricsEndpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"},
                    "authorization": {"type": "object", "required": ["credentials"]},
                    "relabelings": {"type": "array"}}}}}}},
    },
}  # fmt: skip

# the keys of the redis-streams trigger in KEDA 2.x (anything else is a typo KEDA would ignore)
REDIS_STREAMS_KEYS = {"address", "host", "port", "stream", "consumerGroup", "pendingEntriesCount", "lagCount",
                      "activationLagCount", "streamLength", "databaseIndex", "enableTLS", "usernameFromEnv",
                      "passwordFromEnv"}  # fmt: skip


def build(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@needs["kubectl"]
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlay_is_valid(overlay: str) -> None:
    import kubernetes_validate

    docs = build(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "ScaledObject"} <= kinds
    for d in docs:
        key = f"{d['apiVersion']}/{d['kind']}"
        if key in CRD_SCHEMAS:
            jsonschema.validate(d, CRD_SCHEMAS[key])
            continue
        kubernetes_validate.validate(d, "1.31", strict=True)  # raises ValidationError / SchemaNotFoundError
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for kind, name in (("Deployment", "reward-server"), ("Deployment", "buffer"), ("Deployment", "rollout"),
                       ("StatefulSet", "learner"), ("StatefulSet", "redis")):  # fmt: skip
        pod = by[(kind, name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert "readinessProbe" in c and "livenessProbe" in c, name
        assert "dapo-mesh:" in c["image"] or name == "redis"
    assert by[("StatefulSet", "learner")]["spec"]["volumeClaimTemplates"]
    assert "--appendonly yes" in by[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"][0]["args"][0]
    trigger = by[("ScaledObject", "rollout")]["spec"]["triggers"][0]
    assert trigger["type"] == "redis-streams" and set(trigger["metadata"]) <= REDIS_STREAMS_KEYS
    assert trigger["metadata"]["stream"] == "dapo:prompts" and trigger["metadata"]["consumerGroup"] == "rollout"
    # the weight-sync port is exposed by the learner's Service and open to rollout pods only
    learner_svc = by[("Service", "learner")]
    assert {"name": "sync", "port": 29600, "targetPort": "sync"} in learner_svc["spec"]["ports"]
    policy = by[("NetworkPolicy", "learner-sync-from-rollouts")]["spec"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "rollout"}
    config = by[("ConfigMap", "dapo-config")]["data"]
    assert config["DAPO_SYNC_PORT"] == "29600" and "DAPO_AUTH_TOKEN" not in config  # secrets are not config


@needs["kubectl"]
def test_crd_schemas_catch_mistakes() -> None:  # the explicit CRD checks above must be able to fail
    scaled = next(d for d in build("cpu-dev") if d["kind"] == "ScaledObject")
    scaled["spec"]["trigers"] = scaled["spec"].pop("triggers")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, CRD_SCHEMAS["keda.sh/v1alpha1/ScaledObject"])


# ---------------------------------------------------------------------------------------- prometheus


@needs["promtool"]
def test_prometheus_configs_and_rules_check(tmp_path: Path) -> None:
    prom = DEPLOY / "prometheus"
    for args in (["check", "config", "--syntax-only", str(prom / "prometheus.yml")],
                 ["check", "config", str(prom / "local.yml")],
                 ["check", "rules", str(prom / "rules.yml")]):  # fmt: skip
        out = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "rules.yml"
    bad.write_text((prom / "rules.yml").read_text().replace("expr: up{", "expr: up{{"))
    assert subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True).returncode != 0
