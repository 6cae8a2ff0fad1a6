"""Arithmetic the built-in environments share: a safe evaluator (the calculator tool) and reading a final answer."""

from __future__ import annotations

import ast
import hashlib
import operator
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal

_BIN: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_CHARS, MAX_EXPONENT, MAX_DIGITS = 200, 64, 60


def evaluate(expression: str) -> str:
    """+ - * / // % ** and parentheses on numbers, exactly (fractions), nothing else; ValueError otherwise."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return Fraction(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"only whole exponents up to {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        out = Fraction(_BIN[type(node.op)](left, right))
        if len(str(abs(out.numerator))) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return out
    raise ValueError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses")


_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> Fraction | None:
    """The number after the last "Answer:", else the last number in the text (lenient, as the reward server's
    reasoning_gym verifier); None when there is none."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except ValueError:
        return None


def split_of(expression: str, *, eval_share: int = 3) -> Literal["train", "eval"]:
    """The split of a question: one in `eval_share` questions (by a hash; "a + b" and "b + a" are one question)
    is held out, so that an environment with few distinct tasks never evaluates on one it trained on."""
    m = re.fullmatch(r"\s*(\d+)\s*([+*])\s*(\d+)\s*", expression)
    key = f"{min(m[1], m[3], key=int)} {m[2]} {max(m[1], m[3], key=int)}" if m else " ".join(expression.split())
    return "eval" if bucket(key, eval_share) == 0 else "train"


def bucket(key: str, n: int) -> int:
    """A stable bucket in [0, n) for a text (sha256: the same on every machine and run, unlike hash())."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % n
