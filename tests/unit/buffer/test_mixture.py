"""Dataset mixtures (services/datasets.py): parts by weight, each item with its verifier, per-part held-out shares,
and a clear error for each bad spec before any data is read for training."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from mesh.config import MeshConfig, PresetError
from services.datasets import check_spec, load_source

CFG = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def write_rows(path: Path, n: int, *, verifier: str | None = None) -> Path:
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            | ({"verifier": verifier} if verifier else {}) for i in range(n)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_a_mixture_draws_parts_by_weight_with_their_verifiers(tmp_path: Path) -> None:
    f = write_rows(tmp_path / "toy.jsonl", 40)
    spec = f"reasoning_gym:basic_arithmetic=3; file:{f}@math_verify=1"
    src = load_source(spec, size=2000, seed=1, eval_size=40, config=CFG)
    assert len(src.train) == 2000
    by = collections.Counter(it.data_source for it in src.train)
    assert 0.70 < by["reasoning_gym/basic_arithmetic"] / 2000 < 0.80  # weight 3 of 4
    assert {it.verifier for it in src.train if it.data_source == "toy"} == {"math_verify"}
    assert {it.verifier for it in src.train if it.data_source != "toy"} == {"reasoning_gym:basic_arithmetic"}
    held = collections.Counter(it.data_source for it in src.eval)
    assert held == {"reasoning_gym/basic_arithmetic": 30, "toy": 10}  # each part's share of eval_size
    first = collections.Counter(it.data_source for it in src.eval[:8])
    assert first == {"reasoning_gym/basic_arithmetic": 6, "toy": 2}  # interleaved: a prefix (the evaluator's
    # --eval-size of them) holds every part in its share
    train_ids = {it.prompt_id for it in src.train}
    assert not train_ids & {it.prompt_id for it in src.eval}  # never a held-out prompt in training
    again = load_source(spec, size=2000, seed=1, eval_size=40, config=CFG).train
    assert [again[i].prompt_id for i in range(50)] == [src.train[i].prompt_id for i in range(50)]  # same order


def test_held_out_shares_add_up_and_paths_may_hold_separators(tmp_path: Path) -> None:
    from services.datasets import _file_part, apportion

    assert apportion(200, [1, 1, 1]) == [67, 67, 66] and apportion(5, [1, 1]) == [3, 2]
    assert _file_part("file:/d/split=train/x.parquet") == (Path("/d/split=train/x.parquet"), None, 1.0)
    assert _file_part("file:/a@b/x.jsonl@math_verify=2") == (Path("/a@b/x.jsonl"), "math_verify", 2.0)
    assert _file_part("file:/a@b/x.jsonl") == (Path("/a@b/x.jsonl"), None, 1.0)
    f = write_rows(tmp_path / "big.jsonl", 400)
    src = load_source(f"reasoning_gym:basic_arithmetic=9; file:{f}@dapo_math=1", size=500, eval_size=10, config=CFG)
    rows = [src.train[i].prompt_id for i in range(500) if src.train[i].data_source == "toy"]
    assert len(set(rows)) == len(rows) and max(int(r.rsplit("/", 1)[1]) for r in rows) > 100  # not the file's head


def test_a_row_verifier_wins_and_rows_without_one_are_an_error(tmp_path: Path) -> None:
    f = write_rows(tmp_path / "own.jsonl", 10, verifier="dapo_math")
    assert {it.verifier for it in load_source(f"file:{f}@math_verify", eval_size=2).train} == {"dapo_math"}
    bare = write_rows(tmp_path / "bare.jsonl", 10)
    with pytest.raises(ValueError, match="no verifier"):
        load_source(f"file:{bare}", eval_size=2)
    assert {it.verifier for it in load_source(f"file:{bare}", eval_size=2, file_verifier="dapo_math").train} == {
        "dapo_math"
    }


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("reasoning_gym:basic_arithmetic=-1", "must be > 0"),
        ("reasoning_gym:basic_arithmetic=0,chain_sum=0", "must be > 0"),
        ("reasoning_gym:no_such_task", "unknown reasoning-gym tasks"),
        ("reasoning_gym:basic_arithmetic; file:/nope.jsonl", "not found"),
        ("reasoning_gym:basic_arithmetic; parquet:x", "use reasoning_gym"),
        ("reasoning_gym:basic_arithmetic; file:{f}=abc", "not a number"),
        (" ; ", "empty dataset spec"),
    ],
)
def test_bad_specs_are_named_before_anything_starts(tmp_path: Path, spec: str, error: str) -> None:
    spec = spec.format(f=write_rows(tmp_path / "t.jsonl", 4))
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        check_spec(spec)
    with pytest.raises(PresetError, match=error):  # `dapo-mesh up` checks the spec with the rest of the config
        MeshConfig.validated({"run_dir": tmp_path, "dataset": spec})


def test_an_unknown_verifier_and_an_empty_held_out_share_are_errors(tmp_path: Path) -> None:
    f = write_rows(tmp_path / "t.jsonl", 40)
    with pytest.raises(PresetError, match="unknown verifier 'nope'"):
        MeshConfig.validated({"run_dir": tmp_path, "dataset": f"reasoning_gym:basic_arithmetic; file:{f}@nope"})
    with pytest.raises(ValueError, match="no held-out items"):  # 1/1000 of 20 held-out prompts rounds to none
        load_source(f"reasoning_gym:basic_arithmetic=999; file:{f}@dapo_math=1", size=100, eval_size=20, config=CFG)
    with pytest.raises(ValueError, match=r"tasks \['chain_sum'\] would have no held-out items"):
        load_source("reasoning_gym:basic_arithmetic=1000,chain_sum=1", size=100, eval_size=5, config=CFG)
