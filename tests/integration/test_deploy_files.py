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

from services.child_process import ROOT

DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
# a machine without the tool skips; CI (DAPO_REQUIRE_TOOLS=1) fails instead
needs = {tool: pytest.mark.skipif(shutil.which(tool) is None and not os.environ.get("DAPO_REQUIRE_TOOLS"),
                                  reason=f"{tool} is not installed") for tool in ("kubectl", "promtool")}  # fmt: skip


# ---------------------------------------------------------------------------------------- metrics


def exported_metrics() -> set[str]:
    """Every sample name the services can export (counters as *_total, histograms as *_bucket/_sum/_count)."""
    from buffer.metrics import BufferMetrics
    from env_server.metrics import EnvMetrics
    from learner.metrics import LearnerMetrics
    from learner.weight_sync import SyncMetrics
    from reward_server.scoring import RewardMetrics
    from rollout.gateway.metrics import GatewayMetrics
    from rollout.metrics import RolloutMetrics
    from sandbox.app import SandboxMetrics
    from services.streams import StreamMetrics

    registry = CollectorRegistry()
    for cls in (LearnerMetrics, SyncMetrics, RewardMetrics, RolloutMetrics, BufferMetrics, StreamMetrics, EnvMetrics,
                GatewayMetrics, SandboxMetrics):  # fmt: skip
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
    prefixes = ("dapo_reward_", "dapo_env_", "dapo_buffer_", "dapo_rollout_", "dapo_learner_", "dapo_learner_sync_",
                "dapo_gateway_", "dapo_eval_", "dapo_sandbox_")  # fmt: skip
    for prefix in prefixes:
        assert any(m.startswith(prefix) for m in referenced("\n".join(exprs))), prefix
    # Grafana lays the panels out as written: none may cover another
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"{p['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = p["title"]


def test_referenced_finds_names() -> None:  # the check above must be able to fail
    assert referenced("rate(dapo_nope_total[5m]) / dapo_buffer_keep_ratio") - exported_metrics() == {"dapo_nope_total"}


# ---------------------------------------------------------------------------------------- compose

SCRAPED = {"reward-server": 8001, "env-server": 8005, "learner": 8002, "buffer": 8003, "rollout": 8004,
           "router": 8010, "sandbox": 8006}  # HTTP ports  # fmt: skip


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
    expected = set(SCRAPED) | {"redis", "prometheus", "grafana"}  # every service with a port (the sandbox too)
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
    assert "--appendfsync always" in " ".join(services["redis"]["command"])  # what "loses nothing" was measured with
    for svc in SCRAPED:
        env = services[svc]["environment"]
        assert env["DAPO_AUTH_TOKEN"].startswith("${DAPO_AUTH_TOKEN:?"), "the token must be required, not defaulted"
    packages = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert packages
    for f in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / f).read_text()
        assert '"torch==2.13.0"' in text and "USER 10001" in text
        for package in re.findall(r'"(\w+)\*"', packages.group(1)):  # an image without a package cannot start it
            assert f"COPY {package} {package}" in text, f"{f} does not copy the package {package}"


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`docker compose -f base -f override`: mappings merge, anything else is replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_gpu_compose_is_the_same_mesh_on_gpus() -> None:
    """The GPU setup used to be a profile that added learner-gpu beside the CPU learner: two learners consuming as
    learner-0 and writing one volume. It is an override now: the same services, on the CUDA image."""
    import compose_spec

    gpu = merged(compose(), yaml.safe_load((DEPLOY / "compose" / "gpu.yml").read_text()))
    compose_spec.PyCompose.from_json(json.dumps(gpu)).validate()
    assert set(gpu["services"]) == set(compose()["services"])  # no second learner, no second rollout
    for name in ("learner", "rollout"):
        svc = gpu["services"][name]
        assert svc["image"] == "dapo-mesh:cuda" and svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
        assert svc["environment"] == compose()["services"][name]["environment"]
    cmd = gpu["services"]["learner"]["command"]
    assert cmd[cmd.index("--dtype") + 1] == "bf16"


UBUNTU_PYTHON = {"22.04": "3.10 3.11", "24.04": "3.12"}  # the python3.X packages each release ships


def test_images_can_install_their_python_and_own_their_volumes() -> None:
    c = compose()
    mounts = {v.split(":")[1] for svc in c["services"].values() if str(svc.get("image", "")).startswith("dapo-mesh")
              for v in svc.get("volumes", []) if v.split(":")[0] in c["volumes"]}  # fmt: skip
    assert {"/models", "/data/learner", "/data/learner/hf", "/data/weights"} <= mounts
    for f in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / f).read_text()
        owned = re.search(r"mkdir -p ([^\\&]+).*chown -R 10001:10001 ([^\n]+)", text, re.S)
        assert owned, f"{f} creates no volume mount points"
        created = {str(d) for path in owned.group(1).split() for d in (Path(path), *Path(path).parents)}
        assert mounts <= created, f"{f}: volumes mounted on {sorted(mounts - created)} would be root-owned"
        assert all(any(m.startswith(top) for top in owned.group(2).split()) for m in mounts)
    cuda = (DEPLOY / "docker" / "Dockerfile.cuda").read_text()
    release = re.search(r"^FROM \S+ubuntu(\d+\.\d+)", cuda, re.M)
    wanted = re.search(r"install .*python(3\.\d+)", cuda)
    assert release and wanted and wanted.group(1) in UBUNTU_PYTHON[release.group(1)].split()


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
    "monitoring.coreos.com/v1/PrometheusRule": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "required": ["groups"], "additionalProperties": False,
            "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "interval": {"type": "string"}, "rules": {
                    "type": "array", "items": {"type": "object", "required": ["expr"], "additionalProperties": False,
                    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                   "expr": {"type": "string"}, "for": {"type": "string"},
                                   "labels": {"type": "object"}, "annotations": {"type": "object"}}}}}}}}}},
    },
}  # fmt: skip

# the keys of the redis-streams trigger in KEDA 2.x (anything else is a typo KEDA would ignore)
REDIS_STREAMS_KEYS = {"address", "host", "port", "stream", "consumerGroup", "pendingEntriesCount", "lagCount",
                      "activationLagCount", "streamLength", "databaseIndex", "enableTLS", "usernameFromEnv",
                      "passwordFromEnv"}  # fmt: skip
# and of the prometheus trigger
PROMETHEUS_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
                   "customHeaders", "ignoreNullValues", "unsafeSsl", "timeout", "authModes"}  # fmt: skip


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
    expected = {"Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "ScaledObject", "PrometheusRule"}
    assert expected <= kinds
    for d in docs:
        key = f"{d['apiVersion']}/{d['kind']}"
        if key in CRD_SCHEMAS:
            jsonschema.validate(d, CRD_SCHEMAS[key])
            continue
        kubernetes_validate.validate(d, "1.31", strict=True)  # raises ValidationError / SchemaNotFoundError
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for kind, name in (("Deployment", "reward-server"), ("Deployment", "env-server"), ("Deployment", "buffer"),
                       ("Deployment", "rollout"), ("Deployment", "router"), ("Deployment", "sandbox"),
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
    # KEDA's operator runs in its own namespace: the address must name ours
    namespace = by[("Service", "redis")]["metadata"]["namespace"]
    assert trigger["metadata"]["address"] == f"redis-0.redis.{namespace}.svc.cluster.local:6379"
    # the environment service: headless (episodes live in one pod's memory: clients pin each to a pod address);
    # it and the sandbox scaled on what this namespace's pods hold: open episodes, runs waiting for a worker
    assert by[("Service", "env-server")]["spec"]["clusterIP"] == "None"
    for name, metric in (("env-server", "dapo_env_episodes_open"), ("sandbox", "dapo_sandbox_queued_runs")):
        scaler = by[("ScaledObject", name)]["spec"]
        assert scaler["scaleTargetRef"]["name"] == name and ("Deployment", name) in by
        (trigger,) = scaler["triggers"]
        assert trigger["type"] == "prometheus" and set(trigger["metadata"]) <= PROMETHEUS_KEYS
        assert trigger["metadata"]["query"] == f'sum({metric}{{namespace="{namespace}",job="{name}"}})', name
        assert not referenced(trigger["metadata"]["query"]) - exported_metrics()
        assert float(trigger["metadata"]["threshold"]) > 0
    # Prometheus scrapes every mesh pod with an HTTP port (the PodMonitor's job label is the pod's name label)
    monitor = by[("PodMonitor", "dapo-mesh")]["spec"]
    for (kind, name), d in by.items():
        if kind in ("Deployment", "StatefulSet") and name != "redis":
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert selects(monitor["selector"], labels), f"the PodMonitor does not scrape {name}"
            assert any(p["name"] == "http" for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]), name
    # the alerts for the Prometheus Operator are the shipped rules, exactly
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    assert by[("PrometheusRule", "dapo-mesh")]["spec"]["groups"] == rules["groups"]
    # the weight-sync port is exposed by the learner's Service and open to rollout pods only
    learner_svc = by[("Service", "learner")]
    assert {"name": "sync", "port": 29600, "targetPort": "sync"} in learner_svc["spec"]["ports"]
    policy = by[("NetworkPolicy", "learner-sync-from-rollouts")]["spec"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "rollout"}
    config = by[("ConfigMap", "dapo-config")]["data"]
    assert config["DAPO_SYNC_PORT"] == "29600" and "DAPO_AUTH_TOKEN" not in config  # secrets are not config
    assert config["DAPO_ENV_URL"] == "http://env-server:8005"  # the replicas' environment service
    # the one endpoint: a ClusterIP Service in front of the router (not of the replicas: a session lives on one),
    # and each replica's gateway at its pod's own address
    assert by[("Service", "router")]["spec"].get("clusterIP") != "None"
    assert by[("Service", "router")]["spec"]["selector"] == {"app.kubernetes.io/name": "router"}
    replica = by[("Deployment", "rollout")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in replica["env"]}
    assert env["DAPO_GATEWAY_URL"]["value"] == "http://$(POD_IP):8010" and "--gateway-port" in replica["args"]
    # each role its own key of the Secret, optional: absent, the role falls back to the auth token
    for var, key in (("DAPO_REWARD_TOKEN", "reward-token"), ("DAPO_ENV_TOKEN", "env-token"),
                     ("DAPO_SESSION_TOKEN", "session-token"), ("DAPO_SYNC_SECRET", "sync-secret")):  # fmt: skip
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "dapo-secrets", "key": key, "optional": True}, var
    sandbox = by[("Deployment", "sandbox")]["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in sandbox["env"] if e["name"] == "DAPO_SANDBOX_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "dapo-secrets", "key": "sandbox-token", "optional": True}
    assert {"name": "http", "port": 8006, "targetPort": "http"} in by[("Service", "sandbox")]["spec"]["ports"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In or NotIn) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    operators = {"In": lambda v, values: v in values, "NotIn": lambda v, values: v not in values}  # absent: not in
    return all(
        operators[e["operator"]](labels.get(e["key"]), e["values"]) for e in selector.get("matchExpressions", [])
    )


def allowed(policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicies let a pod labelled `src` reach one labelled `dst` on `port` (same namespace): the
    source's egress and the destination's ingress must both allow it, where a policy of that type selects it."""

    def side(pod: dict[str, str], peer: dict[str, str], kind: str) -> bool:
        mine = [
            p["spec"] for p in policies if kind in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod)
        ]
        if not mine:
            return True  # no policy of this type selects the pod: not isolated
        key, peers = ("egress", "to") if kind == "Egress" else ("ingress", "from")
        for spec in mine:
            for rule in spec.get(key, []):
                ports = [x["port"] for x in rule.get("ports", [])]
                if (not ports or port in ports) and any(
                    "namespaceSelector" not in q and selects(q.get("podSelector", {}), peer)
                    for q in rule.get(peers, [])
                ):
                    return True
        return False

    return side(src, dst, "Egress") and side(dst, src, "Ingress")


@needs["kubectl"]
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(overlay: str) -> None:
    """Non-root, no privilege escalation, no capabilities, the runtime's seccomp profile (but for the sandbox), a
    read-only root with the writable paths mounted; and a default-deny network where each pod reaches only what it
    uses."""
    docs = build(overlay)
    unconfined: set[str] = set()
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        name = d["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, name
        if pod["securityContext"]["seccompProfile"] != {"type": "RuntimeDefault"}:
            assert pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"}, name
            unconfined.add(name)
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], c["name"]
            if "dapo-mesh" in c["image"]:
                mounted = {m["mountPath"] for m in c.get("volumeMounts", [])}
                assert {"/tmp", "/home/dapo/.cache"} <= mounted, c["name"]
    # the one exception, documented (base/sandbox.yaml): bubblewrap makes user namespaces, which the RuntimeDefault
    # profiles refuse; otherwise the sandbox is locked down as the rest (non-root, no capabilities, no escalation:
    # checked above for every pod)
    assert unconfined == {"sandbox"}
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
               and not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies)  # fmt: skip

    def pod(name: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "dapo-mesh"}

    for client in ("buffer", "learner", "rollout"):
        assert allowed(policies, pod(client), pod("redis"), 6379), client
    assert not allowed(policies, pod("reward-server"), pod("redis"), 6379)  # it never uses Redis
    assert allowed(policies, pod("rollout"), pod("reward-server"), 8001)
    assert not allowed(policies, pod("buffer"), pod("reward-server"), 8001)
    assert allowed(policies, pod("rollout"), pod("learner"), 29600)  # the weight-sync rendezvous
    assert allowed(policies, pod("learner"), pod("rollout"), 41234) and allowed(
        policies, pod("rollout"), pod("rollout"), 41234
    )
    assert not allowed(policies, pod("reward-server"), pod("learner"), 29600)
    assert not allowed(policies, pod("buffer"), pod("learner"), 8002)
    assert allowed(policies, pod("rollout"), pod("env-server"), 8005)  # the environment service
    assert not allowed(policies, pod("rollout"), pod("env-server"), 8001)
    for other in ("buffer", "learner", "reward-server"):
        assert not allowed(policies, pod(other), pod("env-server"), 8005), other
    assert not allowed(policies, pod("env-server"), pod("redis"), 6379)  # it never uses Redis
    assert not allowed(policies, pod("env-server"), pod("learner"), 29600)
    # the router: agents from anywhere on 8010; it reaches each replica's gateway and Redis (heartbeats), nothing else
    assert allowed(policies, pod("router"), pod("rollout"), 8010)
    assert allowed(policies, pod("router"), pod("redis"), 6379)
    assert not allowed(policies, pod("router"), pod("reward-server"), 8001)
    assert not allowed(policies, pod("router"), pod("rollout"), 8004)
    assert not allowed(policies, pod("buffer"), pod("rollout"), 8010)
    (router,) = [p["spec"] for p in policies if p["metadata"]["name"] == "router"]
    assert router["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8010}]}]  # any source, this port only
    # the sandbox: the reward server and the environment service call it, no one else; it calls no one
    for caller in ("reward-server", "env-server"):
        assert allowed(policies, pod(caller), pod("sandbox"), 8006), caller
    for other in ("rollout", "buffer", "learner", "router"):
        assert not allowed(policies, pod(other), pod("sandbox"), 8006), other
    assert not allowed(policies, pod("reward-server"), pod("sandbox"), 8001)  # its port only
    assert not allowed(policies, pod("sandbox"), pod("redis"), 6379)
    assert not allowed(policies, pod("sandbox"), pod("reward-server"), 8001)
    assert not allowed(policies, pod("sandbox"), pod("env-server"), 8005)
    # nothing at all, DNS included: no policy with an egress rule selects it (the DNS one selects every other pod)
    egress = {p["metadata"]["name"]: p["spec"] for p in policies if p["spec"].get("egress")}
    assert not [name for name, spec in egress.items() if selects(spec["podSelector"], pod("sandbox"))]
    for other in ("reward-server", "env-server", "buffer", "learner", "rollout", "router", "redis"):
        assert selects(egress["dns-egress"]["podSelector"], pod(other)), other


@needs["kubectl"]
def test_the_learner_on_n_nodes_is_one_consistent_group() -> None:
    """components/learner-ranks: N pods that start together, one torchrun node each (pod index = node rank),
    sharing one checkpoint directory, reaching each other, and drained one at a time."""
    docs = build("gpu-learner-ranks")
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    sts = by[("StatefulSet", "learner")]["spec"]
    n = sts["replicas"]
    c = sts["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"][: c["args"].index("-m")])
    assert n >= 2 and sts["podManagementPolicy"] == "Parallel"
    assert args["nnodes"] == str(n) and args["node-rank"] == "$(POD_INDEX)"
    assert args["master-addr"] == "learner-0.learner"
    assert c["args"][c["args"].index("-m") + 1] == "learner" and "--dtype=bf16" in c["args"]  # the GPU overlay's too
    index = next(e for e in c["env"] if e["name"] == "POD_INDEX")
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    claim = next(v for v in sts["template"]["spec"]["volumes"] if v["name"] == "shared")
    pvc = by[("PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["metadata"]["namespace"] == "dapo"
    assert {"name": "shared", "mountPath": "/data/learner"} in c["volumeMounts"]
    assert sts["template"]["spec"]["terminationGracePeriodSeconds"] >= 120  # a checkpoint finishes
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # one GPU per rank
    pdb = by[("PodDisruptionBudget", "learner")]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"] == {"app.kubernetes.io/name": "learner"}
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    learner = {"app.kubernetes.io/name": "learner", "app.kubernetes.io/part-of": "dapo-mesh"}
    assert allowed(policies, learner, learner, 29500) and allowed(policies, learner, learner, 41234)
    assert not allowed(policies, {"app.kubernetes.io/name": "buffer"}, learner, 29500)


@needs["kubectl"]
def test_crd_schemas_catch_mistakes() -> None:  # the explicit CRD checks above must be able to fail
    scaled = next(d for d in build("cpu-dev") if d["kind"] == "ScaledObject")
    scaled["spec"]["trigers"] = scaled["spec"].pop("triggers")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, CRD_SCHEMAS["keda.sh/v1alpha1/ScaledObject"])


@needs["kubectl"]
def test_the_hpa_component_is_valid(tmp_path: Path) -> None:
    """components/hpa (the alternative to KEDA, in no overlay): the base with it builds and validates, and each
    HPA scales a Deployment of the base."""
    import kubernetes_validate

    k8s = DEPLOY / "k8s"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(k8s / "base", tmp_path)],
        "components": [os.path.relpath(k8s / "components" / "hpa", tmp_path)]}))  # fmt: skip
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert {h["metadata"]["name"] for h in hpas} == {"rollout", "env-server", "sandbox"}
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    for h in hpas:
        kubernetes_validate.validate(h, "1.31", strict=True)
        assert h["spec"]["scaleTargetRef"]["name"] in deployments


# ---------------------------------------------------------------------------------------- prometheus


def test_compose_prometheus_scrapes_every_service_and_alerts_when_one_is_down() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(SCRAPED) <= set(jobs)
    for name, port in SCRAPED.items():
        job = jobs[name]
        targets = [t for s in job.get("static_configs", []) for t in s["targets"]]
        targets += [f"{n}:{d['port']}" for d in job.get("dns_sd_configs", []) for n in d["names"]]
        assert targets == [f"{name}:{port}"], (name, targets)
        assert job["authorization"]["credentials_file"] == "/run/secrets/dapo_auth_token"
        command = compose()["services"][name]["command"]
        assert command[command.index("--port") + 1] == str(port), name
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    down = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "DapoServiceDown")
    jobs_regex = re.search(r'job=~"([^"]+)"', down["expr"])
    assert jobs_regex and set(jobs_regex.group(1).split("|")) == set(SCRAPED)


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
