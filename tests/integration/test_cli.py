"""`dapo-mesh` commands as a user runs them: up (model + embedded Redis + transport check), status."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.schemas import ScoredGroup
from services.selfcheck import example_group
from services.streams import STREAM_ROLLOUTS, StreamConsumer, StreamProducer, connect

CLI = [sys.executable, "-m", "mesh"]


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != "DAPO_REDIS_URL"} | env | {"COLUMNS": "200"}
    return subprocess.run(CLI + args, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def up_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path_factory.mktemp("run")
    root = Path(__file__).resolve().parents[2]
    return run(["up", "--check", "--run-dir", str(run_dir)], cwd=root, PYTHONPATH=str(root)), run_dir


@pytest.mark.slow
def test_up_prepares_model_runs_embedded_redis_and_checks_transport(up_run) -> None:
    r, run_dir = up_run
    assert r.returncode == 0, r.stderr
    assert "redis: embedded, redis://127.0.0.1:" in r.stdout
    for name in ("PromptTask", "Sample", "ScoredGroup", "TrainBatch", "WeightVersion", "ReplicaHeartbeat"):
        assert f"✓ {name} round-trips" in r.stdout
    assert any((run_dir / "redis").rglob("*.aof"))
    pid_lines = [ln for ln in r.stderr.splitlines() if "embedded Redis pid" in ln]
    pid = int(pid_lines[0].split("pid ")[1].split()[0])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_prepared_model_matches_the_gguf(up_run) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from services.model_prep import smollm2_gguf

    _, run_dir = up_run
    model_dir = run_dir / "models/smollm2-135m-instruct"
    assert (model_dir / "model.safetensors").stat().st_size > 500e6
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("What is 12 + 30? Answer:", return_tensors="pt").input_ids
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gguf = smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_status_shows_groups_pending_and_lag(embedded_redis) -> None:
    client = connect(embedded_redis.url)
    client.delete(STREAM_ROLLOUTS)
    StreamProducer(client, STREAM_ROLLOUTS).publish_many(example_group(i, n_tokens=2) for i in range(5))
    StreamConsumer(client, STREAM_ROLLOUTS, "buffer", "b0", ScoredGroup).read(count=2)
    root = Path(__file__).resolve().parents[2]
    r = run(["status", "--redis-url", embedded_redis.url], cwd=root, PYTHONPATH=str(root))
    client.delete(STREAM_ROLLOUTS)
    assert r.returncode == 0, r.stderr
    [row] = [ln for ln in r.stdout.splitlines() if STREAM_ROLLOUTS in ln]
    cells = [c.strip() for c in row.split("│")[1:7]]
    assert cells == [STREAM_ROLLOUTS, "5", "buffer", "1", "2", "3"]  # length, group, consumers, pending, lag


def test_status_shows_versions_sync_and_replicas(embedded_redis) -> None:
    from services.schemas import ReplicaHeartbeat, SyncGroup, WeightVersion
    from services.streams import (
        KEY_BUFFER_LEASE,
        KEY_POLICY_VERSION,
        KEY_SYNC_GROUP,
        KEY_WEIGHTS,
        REPLICA_KEY_PREFIX,
        pack,
    )

    client = connect(embedded_redis.url)
    keys = [KEY_POLICY_VERSION, KEY_WEIGHTS, KEY_SYNC_GROUP, REPLICA_KEY_PREFIX + "r-7", KEY_BUFFER_LEASE]
    client.set(keys[0], 12)
    client.set(keys[4], "buffer-1:0123abcd", px=60_000)
    client.set(keys[1], pack(WeightVersion(version=12, step=48, checksum=987654, replicas=["r-7"], sync_seconds=0.4)))
    client.set(keys[2], pack(SyncGroup(generation=3, host="10.0.0.5", port=29600, candidates=["r-7"], timeout_s=60)))
    hb = ReplicaHeartbeat(replica_id="r-7", host="h", port=1, weight_version=11, state="ready", weight_checksum=555,
                          sync_broadcast=True, tokens_per_s=240.0)  # fmt: skip
    client.set(keys[3], pack(hb))
    root = Path(__file__).resolve().parents[2]
    r = run(["status", "--redis-url", embedded_redis.url], cwd=root, PYTHONPATH=str(root))
    client.delete(*keys)
    assert r.returncode == 0, r.stderr
    assert "learner policy version: 12" in r.stdout
    lease = re.search(r"buffer leader: buffer-1:0123abcd \(lease (\d+\.\d) s left\)", r.stdout)
    assert lease and 0 < float(lease[1]) <= 60.0, r.stdout  # what is left of 60 s: the CLI's start on a loaded machine
    assert "weights broadcast: version 12 to r-7" in r.stdout and "checksum 987654" in r.stdout
    assert "generation 3 at 10.0.0.5:29600" in r.stdout
    [row] = [ln for ln in r.stdout.splitlines() if "r-7" in ln and "│" in ln]
    assert [c.strip() for c in row.split("│")[1:6]] == ["r-7", "ready", "11", "555", "240"]


def test_status_finds_the_local_runs_embedded_redis(embedded_redis, tmp_path: Path) -> None:
    """`dapo-mesh status` with no Redis URL reads the local run's embedded Redis (RUN_DIR/run.json, written by `up`),
    not :6379; with no run and no Redis there, it says so in one line."""
    from mesh.layout import RunFile, RunLayout
    from services.streams import KEY_POLICY_VERSION

    client = connect(embedded_redis.url)
    client.set(KEY_POLICY_VERSION, 31)
    (tmp_path / ".dapo").mkdir()
    RunFile(embedded_redis.url, []).write(RunLayout(tmp_path / ".dapo"))
    root = Path(__file__).resolve().parents[2]
    r = run(["status"], cwd=tmp_path, PYTHONPATH=str(root))
    client.delete(KEY_POLICY_VERSION)
    assert r.returncode == 0, r.stderr
    assert f"redis: {embedded_redis.url}" in r.stdout and "learner policy version: 31" in r.stdout
    nowhere = tmp_path / "elsewhere"
    nowhere.mkdir()
    r = run(["status", "--run-dir", str(nowhere / ".dapo"), "--redis-url", "redis://127.0.0.1:1/0"], cwd=nowhere,
            PYTHONPATH=str(root))  # fmt: skip
    assert r.returncode == 1 and "no mesh at redis://127.0.0.1:1/0" in r.stderr, r.stderr


def test_up_checks_your_environment_servers_before_starting_anything(tmp_path: Path) -> None:
    """A preset naming environment servers by URL: `dapo-mesh up` checks each (reachable, dapo-env/1, its token, the
    dataset's environments served) before it starts anything, and says what is wrong in one line (exit 2)."""
    from services.redis_server import free_port
    from tests.integration import third_party_env

    root = Path(__file__).resolve().parents[2]
    base = ["up", "--tiny", "--run-dir", str(tmp_path / "run"), "--set", 'mesh.dataset="env:guess"']
    with third_party_env.serve(name="guess", token="the-token") as url:
        cases = [
            (f'[{{url="http://127.0.0.1:{free_port()}"}}]', {}, "not reachable"),
            (f'[{{url="{url}"}}]', {}, "refused a request without a token (set its token_env) (401)"),
            (f'[{{url="{url}", token_env="GUESS_TOKEN"}}]', {}, "its token_env GUESS_TOKEN is not set"),
            (f'[{{url="{url}", token_env="GUESS_TOKEN"}}]', {"GUESS_TOKEN": "no"}, "refused the token in $GUESS_TOKEN"),
            (f'[{{url="{url}/x", token_env="T"}}]', {"T": "the-token"}, "GET /v1/envs answered 404"),
        ]
        for servers, env, said in cases:
            r = run([*base, "--set", f"mesh.env_servers={servers}"], cwd=root, PYTHONPATH=str(root), **env)
            assert r.returncode == 2, r.stdout + r.stderr
            (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert line.startswith("invalid mesh config: env server") and said in line, line
            assert not (tmp_path / "run" / "logs").exists()  # nothing started
        ok = f'mesh.env_servers=[{{url="{url}", token_env="GUESS_TOKEN"}}]'
        r = run([*base, "--set", ok, "--set", 'mesh.dataset="env:maze"'], cwd=root, PYTHONPATH=str(root),
                GUESS_TOKEN="the-token")  # fmt: skip
        assert r.returncode == 2 and "dataset env:maze: no environment server serves it" in r.stderr, r.stderr
        assert f"{url}: guess" in r.stderr
    r = run([*base, "--set", 'rollout.env_url="http://127.0.0.1:9"'], cwd=root, PYTHONPATH=str(root))
    assert r.returncode == 2 and "name your own environment servers in [mesh] env_servers" in r.stderr, r.stderr


def test_up_serves_a_client_scored_dataset_through_the_gateway_only(tmp_path: Path) -> None:
    """Rows that say `"verifier": "client"` are scored by the client of a gateway session: `dapo-mesh up` refuses to
    start them without the gateway (the replicas would dead-letter them), or with a held-out evaluation (nothing in
    the mesh scores them), before anything starts."""
    import json

    data = tmp_path / "own.jsonl"
    rows = [{"prompt": f"Say {i}.", "reward_model": {"ground_truth": ""}, "verifier": "client"} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = Path(__file__).resolve().parents[2]
    base = ["up", "--tiny", "--run-dir", str(tmp_path / "run"), "--set", f'mesh.dataset="file:{data}"']
    r = run(base, cwd=root, PYTHONPATH=str(root))
    assert r.returncode == 2 and "serve them through the gateway only ([mesh] gateway_port" in r.stderr, r.stderr
    gateway = ["--engine", "vllm", "--set", "mesh.gateway_port=18999", "--set", "rollout.gateway_only=true"]
    r = run([*base, *gateway, "--eval-every", "3"], cwd=root, PYTHONPATH=str(root))
    assert r.returncode == 2 and "no scorer in the mesh for a held-out evaluation" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


@pytest.mark.slow
def test_prepare_model_from_a_local_hf_folder(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from learner.tiny import tiny_llama

    src = tiny_llama(tmp_path / "src")
    root = Path(__file__).resolve().parents[2]
    r = run(["prepare-model", "--source", str(src), "--out", str(tmp_path / "out")], cwd=root, PYTHONPATH=str(root))
    assert r.returncode == 0, r.stderr
    a = AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r = run(["prepare-model", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")], cwd=root)
    assert r.returncode != 0 and "neither an HF model folder nor a .gguf file" in r.stderr + r.stdout


@pytest.mark.slow
def test_merge_an_adapter_and_refuse_to_evaluate_one_unmerged(tmp_path: Path) -> None:
    """`dapo-mesh merge` (issue 31): a LoRA snapshot + its base -> a plain HF folder with the adapter's logits;
    another base is refused; `dapo-mesh eval --model ADAPTER` says to merge first."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from learner.tiny import tiny_llama
    from services.adapters import AdapterInfo, fingerprint, write_info

    base, other = tiny_llama(tmp_path / "base"), tiny_llama(tmp_path / "other", seed=3)
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    write_info(tmp_path / "adapter", AdapterInfo(fingerprint(base), 4, 8.0, ("q_proj", "v_proj")))
    root = Path(__file__).resolve().parents[2]
    args = ["merge", "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged"), "--base"]
    r = run([*args, str(base)], cwd=root, PYTHONPATH=str(root))
    assert r.returncode == 0, r.stderr
    ids = torch.tensor([[3, 50, 7, 120]])
    with torch.no_grad():
        want = peft(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    r = run([*args[:-2], str(tmp_path / "m2"), "--base", str(other)], cwd=root, PYTHONPATH=str(root))
    assert r.returncode != 0 and "trained on base" in r.stderr + r.stdout
    r = run(["eval", "--model", str(tmp_path / "adapter")], cwd=root, PYTHONPATH=str(root))
    assert r.returncode != 0 and "merge it into its base first" in r.stderr + r.stdout
