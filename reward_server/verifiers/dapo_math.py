"""The DAPO rule reward (arXiv 2503.14476, §3.3 "Rule-based reward"), behaving exactly like the
reference its authors released in verl (`verl/utils/reward_score/math_dapo.py`, `compute_score`).

    verdict = dapo_math("... so the total is 12.\\nAnswer: 12", "12")   # Verdict(1.0, True, "12")

What it does, in the reference's order:
1. Only the last 300 characters of the response count.
2. The prediction is the last case-insensitive `Answer: ...` match (rest of that line), normalised
   Minerva-style; the ground truth is normalised the same way; correct = string equality.
3. With no `Answer:` match, fall back to the last `\\boxed{...}` in the final 100 of those 300
   characters, compared *unnormalised* with the *raw* ground truth (as the reference does).
4. Score +1.0 / -1.0; `pred` is the normalised prediction, the raw boxed content, or "[INVALID]".
Pure and linear in its input: the response is cut to 300 characters and the ground truth normalises in linear
time, so it runs in-process; the server sends a ground truth longer than `INLINE_MAX_GROUND_TRUTH` characters
to the worker pool all the same, under the per-item time limit (reward_server/scoring.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from reward_server.verifiers.base import Verdict

TAIL_CHARS = 300  # the reference keeps this many ("the longest answer in MATH-500 has 159 characters")
BOX_TAIL_CHARS = 100
INVALID = "[INVALID]"
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INLINE_MAX_GROUND_TRUTH = 4096  # characters: longer ones are verified in the worker pool

# Minerva normaliser data (lm-evaluation-harness hendrycks_math), order matters.
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)
_FIXED_WIDTH = (
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)  # linear as they are


# The reference rewrites with five more regexes before those two: r"(.*?)(\$)(.*?)(\$)(.*)" -> "$\3$" (keep the
# first $...$ span), r"(\\text\{)(.*?)(\})" -> "\2" (and \textbf, \overline), r"(\\boxed\{)(.*)(\})" -> "\2".
# `.` stops at a newline and a failed match is tried again from every later position, so on a long line without
# the closing character they take quadratic time (0.22 s at 4k characters, minutes at 100k). The functions below
# make the same rewrites line by line in linear time; the parity tests
# (tests/unit/reward_server/test_dapo_math.py) hold them
# to the reference.


def _first_dollar_span(line: str) -> str:
    """A line with two `$` becomes its first $...$ span (a match consumes the whole line)."""
    i = line.find("$")
    j = line.find("$", i + 1) if i >= 0 else -1
    return line if j < 0 else "$" + line[i + 1 : j] + "$"


def _unwrap_shortest(opener: str) -> Callable[[str], str]:
    """Every `opener`...`}` -> ..., up to the first `}` after the opener; left to right, no overlaps."""

    def rewrite(line: str) -> str:
        out, pos = [], 0
        while (i := line.find(opener, pos)) >= 0 and (j := line.find("}", i + len(opener))) >= 0:
            out += [line[pos:i], line[i + len(opener) : j]]
            pos = j + 1
        return "".join(out) + line[pos:]

    return rewrite


def _unwrap_boxed(line: str) -> str:
    """The first `\\boxed{` ... the line's last `}` -> ... (greedy: at most one match per line)."""
    opener = "\\boxed{"
    i, j = line.find(opener), line.rfind("}")
    return line if i < 0 or j < i + len(opener) else line[:i] + line[i + len(opener) : j] + line[j + 1 :]


_LINE_REWRITES = (
    _first_dollar_span,
    _unwrap_shortest("\\text{"),
    _unwrap_shortest("\\textbf{"),
    _unwrap_shortest("\\overline{"),
    _unwrap_boxed,
)


def normalize(answer: str) -> str:
    """Minerva-style normalisation of a final answer (the reference's `normalize_final_answer`), linear time."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    for rewrite in _LINE_REWRITES:
        answer = "\n".join(rewrite(line) for line in answer.split("\n"))
    for pattern, repl in _FIXED_WIDTH:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # 1,000 -> 1000
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces balance, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
    return None


def dapo_math(response: str, ground_truth: str) -> Verdict:
    tail = response[-TAIL_CHARS:]
    matches = ANSWER_LINE.findall(tail)
    pred = normalize(matches[-1] if matches else INVALID)
    correct = pred == normalize(ground_truth)
    if pred == INVALID:
        boxed = last_boxed(tail[-BOX_TAIL_CHARS:])
        if boxed is not None:
            pred, correct = boxed, boxed == ground_truth
    return Verdict(score=1.0 if correct else -1.0, acc=correct, pred=pred)
