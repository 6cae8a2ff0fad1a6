"""Runs a rollout replica: HTTP (health, metrics) from a thread, the heartbeat and the weight receiver from two
more, the loop here.

    python -m rollout --model-dir DIR --redis-url URL --reward-url http://127.0.0.1:8001 ...

Loads the engine and the newest weights, then steps the replica's loop until stopped: continuous batching
(rollout/continuous_loop.py) with vLLM, engine calls (rollout/chunked_loop.py) with HF, or vLLM and --no-stream.
Both loops hold the same parts (rollout/replica.py).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import httpx
import redis

from rollout.chunked_loop import ChunkedLoop
from rollout.continuous_loop import ContinuousLoop
from rollout.engines import load_engine
from rollout.gateway.app import create_gateway_app
from rollout.gateway.core import Gateway
from rollout.gateway.metrics import GatewayMetrics
from rollout.metrics import RolloutMetrics
from rollout.replica import Loop, Replica
from rollout.reward_client import RewardClient
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from services.dtype import resolve_dtype
from services.placement import place
from services.service_process import ServiceProcess
from services.session_keys import replica_tag
from services.settings import role_token
from services.web import serve_in_thread

log = logging.getLogger(__name__)


def engine_placement(s: RolloutSettings) -> dict[str, Any]:
    """vLLM binds its OpenMP pool itself (VLLM_CPU_OMP_THREADS_BIND); the HF engine is torch in this process."""
    if s.engine == "hf":
        place(s.cpu_cores, None, log)
        return {}
    return {
        "kv_cache_gib": s.vllm_kv_cache_gib,
        "eager": s.vllm_eager,
        "cpu_cores": s.cpu_cores,
        "lora_max_rank": s.lora_max_rank,
        "lora_serving": s.lora_serving,
    }


def build(
    s: RolloutSettings,
    client: redis.Redis,
    reward: RewardClient,
    metrics: RolloutMetrics,
    receiver: WeightReceiver | None,
) -> tuple[Replica, Loop]:
    """The engine, the replica's parts and its loop. vLLM: continuous batching (in-flight weight updates); HF, or
    vLLM with --no-stream: engine calls of `prompts_per_call` prompts, weights between calls."""
    dtype = resolve_dtype(s.dtype, log)
    if s.lora_max_rank and s.engine != "vllm":
        raise ValueError("--lora-max-rank: adapters are served by the vllm engine (vLLM's LoRA), not the hf engine")
    if s.lora_max_rank:
        from rollout.engines.lora import check_servable, resolve_serving, served_dtype

        check_servable(s.model_dir, s.lora_max_rank, serving=s.lora_serving)
        served = served_dtype(resolve_serving(s.lora_serving), dtype, s.dtype)
        if served != dtype:
            log.info("dtype fp32: merged adapters (a merged bf16 weight would lose the adapter's small updates)")
        dtype = served
    if s.engine == "vllm" and s.stream:
        engine = load_engine(
            s.model_dir,
            s.engine,
            dtype=dtype,
            batching="continuous",
            update=s.weight_update,
            seed=s.seed,
            **engine_placement(s),
        )
        replica = Replica.build(s, client, engine, reward, metrics, receiver)
        log.info(
            "continuous batching: up to %d sequences in flight, weight updates: %s", s.max_in_flight, s.weight_update
        )
        gateway = None
        if s.gateway_port is not None:
            # its environments' tasks go through the replica's one environment-call path (rollout/env_calls.py)
            tag = replica_tag(s.replica_id, replica.membership.incarnation)  # as its heartbeat names it
            gateway = Gateway(s, engine.tokenizer, GatewayMetrics(metrics.registry), replica.episodes.env, tag)
        return replica, ContinuousLoop(replica, engine, gateway)
    if s.gateway_port is not None:
        raise ValueError("--gateway-port: the gateway is served by the vllm engine's continuous batching")
    chunked = load_engine(s.model_dir, s.engine, dtype=dtype, **engine_placement(s))
    replica = Replica.build(s, client, chunked, reward, metrics, receiver)
    log.info("%s engine: %d prompts per engine call, weights loaded between calls", s.engine, s.prompts_per_call)
    return replica, ChunkedLoop(replica, chunked)


def advertised(s: RolloutSettings) -> str:
    """The gateway's address for the router: --gateway-url, else the bind address and port (this machine's address
    when it binds every interface)."""
    if s.gateway_url:
        return s.gateway_url.rstrip("/")
    host = s.host
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{s.gateway_port}"


def reward_client(s: RolloutSettings) -> RewardClient:
    secret = role_token(s, "reward_token")
    token = secret.get_secret_value() if secret else None
    return RewardClient(s.reward_url, token=token, timeout_s=s.reward_timeout_s, retries=s.reward_retries)


def check_credentials(s: RolloutSettings) -> None:
    """A replica whose token a peer refuses is a configuration error: it stops at start-up with what to set, before
    it loads an engine or takes a prompt (a refused token mid-run would otherwise fail every prompt it takes). A
    peer that does not answer yet is not an error: the replica waits for it as for any outage."""
    auth = " (or DAPO_AUTH_TOKEN, which it falls back to)"
    probes = [
        (
            "reward server",
            "POST",
            f"{s.reward_url}/v1/score",
            role_token(s, "reward_token"),
            "DAPO_REWARD_TOKEN" + auth,
        ),
        ("environment service", "GET", f"{s.env_url}/v1/envs", role_token(s, "env_token"), "DAPO_ENV_TOKEN" + auth),
    ]
    for name, url in s.env_routes.items():
        secret = s.env_route_tokens.get(name)
        probes.append(
            (f"{name}'s environment server", "GET", f"{url}/v1/envs", secret, f"DAPO_ENV_ROUTE_TOKENS[{name}]")
        )
    for name, method, url, secret, var in probes:
        headers = {"Authorization": f"Bearer {secret.get_secret_value()}"} if secret else {}
        try:
            status = httpx.request(method, url, json={"items": []}, headers=headers, timeout=5).status_code
        except httpx.HTTPError as e:
            log.info("the %s at %s does not answer yet (%s): its tasks wait for it", name, url, type(e).__name__)
            continue
        if status in (401, 403):
            sent = "its token" if secret else "no token"
            raise SystemExit(
                f"the {name} at {url} refused this replica's credentials ({status}, {sent} sent): set {var} to the "
                f"{name}'s token"
            )


def run(settings: RolloutSettings, stop: threading.Event) -> Replica:
    s = settings
    check_credentials(s)
    reward = reward_client(s)
    servers: list[Any] = []  # the gateway's
    beat_stop = threading.Event()
    heartbeat: threading.Thread | None = None
    with ServiceProcess("rollout", s, loading="loading the engine") as proc:
        try:
            metrics = RolloutMetrics(proc.registry)
            receiver = WeightReceiver(s, proc.client, metrics) if s.sync_broadcast else None
            replica, loop = build(s, proc.client, reward, metrics, receiver)
            member = replica.membership
            replica.evaluator.stopping = stop.is_set  # SIGTERM ends a seeded evaluation between two engine calls
            gateway = getattr(loop, "gateway", None)

            def ready() -> tuple[bool, str]:  # with a gateway: once it listens too (a client is told to come)
                if member.state == "ready" and gateway is not None and not (servers and servers[0].started):
                    return False, "the gateway is starting"
                return member.state == "ready", member.state

            proc.ready_when(ready)
            member.sync_weights()  # a late joiner starts from the newest snapshot, then joins the next round
            member.warm_up()
            metrics.version.set(member.engine.version)
            member.heartbeat()
            heartbeat = threading.Thread(
                target=member.heartbeat_forever, args=(beat_stop,), name="heartbeat", daemon=True
            )
            heartbeat.start()
            threading.Thread(target=member.leave_when, args=(stop, beat_stop), name="leave", daemon=True).start()
            if receiver is not None:
                threading.Thread(target=receiver.run, args=(beat_stop,), name="weight-sync", daemon=True).start()
            if gateway is not None:
                assert s.gateway_port is not None
                app = create_gateway_app(gateway, reward_client(s))
                servers.append(serve_in_thread(app, s, port=s.gateway_port))
                member.gateway_url, member.gateway_load = advertised(s), gateway.load
            log.info("replica %s ready (%s engine, version %d)", s.replica_id, s.engine, member.engine.version)
            try:
                while not stop.is_set() and (s.max_prompts is None or replica.publisher.done < s.max_prompts):
                    loop.step()
            finally:  # a crash too: the episodes open on the environment service are closed
                try:
                    loop.close()
                except Exception:  # the crash's own exception (if any) is the one to raise
                    log.exception("closing the rollout loop")
            return replica
        finally:
            for server in servers:
                server.should_exit = True
            beat_stop.set()
            if heartbeat is not None:  # it deletes its key on the way out: before the client closes
                heartbeat.join(10)
            reward.close()
