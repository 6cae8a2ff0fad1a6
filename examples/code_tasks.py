"""Generated function-writing tasks with their tests, as a verl-schema jsonl (verifier `code`, MBPP's assert layout).

    python examples/code_tasks.py --out configs/data/code-fns.jsonl [--n 3000] [--seed 0]

Each task asks for one small Python function of one integer and carries five assertions on it:

    Write a Python function `f(x)` that returns x times 3 plus 2.
    -> {"asserts": ["assert f(4) == 14", ...]}

The kinds are a ladder a 135M instruct model climbs from a few percent: arithmetic of x, comparisons, digits.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

PROMPT = (
    "Write a Python function `f(x)` that takes an integer x and returns {what}.\n"
    "Reply with the function in a ```python code block."
)


def kinds(r: random.Random) -> list[tuple[str, Callable[[int], object]]]:
    a, b = r.randint(2, 49), r.randint(1, 49)
    return [
        (f"x plus {a}", lambda x: x + a),
        (f"x minus {a}", lambda x: x - a),
        (f"x times {a}", lambda x: x * a),
        (f"x times {a} plus {b}", lambda x: x * a + b),
        ("the square of x", lambda x: x * x),
        (f"the larger of x and {a}", lambda x: max(x, a)),
        (f"the smaller of x and {a}", lambda x: min(x, a)),
        (f"the remainder of x divided by {a}", lambda x: x % a),
        ("True if x is even, else False", lambda x: x % 2 == 0),
        (f"True if x is greater than {a}, else False", lambda x: x > a),
        ("the last digit of x", lambda x: x % 10),
        ("x doubled, minus 1", lambda x: 2 * x - 1),
    ]


def task(i: int, seed: int) -> dict[str, object]:
    r = random.Random(seed * 1_000_003 + i)
    what, fn = r.choice(kinds(r))
    xs = r.sample(range(0, 50), 5)
    asserts = [f"assert f({x}) == {fn(x)!r}" for x in xs]
    return {
        "data_source": "code-fns",
        "prompt": [{"role": "user", "content": PROMPT.format(what=what)}],
        "reward_model": {"ground_truth": json.dumps({"asserts": asserts})},
        "verifier": "code",
        "extra_info": {"index": i},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = {}
    for i in range(args.n * 20):  # distinct prompts only: a held-out question is never one trained on
        row = task(i, args.seed)
        rows.setdefault(json.dumps(row["prompt"]), row)
        if len(rows) == args.n:
            break
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for j, row in enumerate(rows.values()):
            row["extra_info"] = {"index": j}
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} tasks -> {args.out}")


if __name__ == "__main__":
    main()
