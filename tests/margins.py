"""Tolerance audit: how close each floating-point comparison of the suite comes to its bound.

Off by default. ``make margins`` (or ``MHLA_MARGINS=<file.jsonl> pytest ...`` with
``PYTEST_ADDOPTS="-o enable_assertion_pass_hook=true"``) records, for every passing comparison:

- each ``assert <value> < <bound>`` / ``<=`` / ``>`` / ``>=`` of numbers (``tensor(x)`` scalars and
  products such as ``TOL[dtype] * 10`` included), read from pytest's assertion explanation;
- each ``torch.testing.assert_close``, ``torch.allclose`` / ``Tensor.allclose``,
  ``numpy.testing.assert_allclose`` and ``numpy.allclose`` called from a test file, as the worst
  element's share of its allowance: ``max |a - b| / (atol + rtol |b|)``.

One JSON line per comparison: ``{"test", "where", "kind", "observed", "bound"}``; ``kind`` is
``"upper"`` (observed must stay below bound) or ``"lower"`` (above). The margin is
``bound / observed`` (upper) or ``observed / bound`` (lower); the house rule is a margin of at least
10 over the worst machine. ``python tests/margins.py FILE...`` merges runs (several CPUs, BLAS core
types) by keeping each comparison's worst value and prints the tightest margins.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
_OPS = {"<": "upper", "<=": "upper", ">": "lower", ">=": "lower"}
_ARITH = {ast.Mult: operator.mul, ast.Div: operator.truediv, ast.Add: operator.add, ast.Sub: operator.sub, ast.Pow: operator.pow}
_TENSOR = re.compile(r"tensor\(\s*([-+0-9.eEinfna]+)(?:,[^)]*)?\)")
_COMPARE = re.compile(r"\s(<=|>=|<|>)\s")


def _number(text: str) -> float | None:
    """The value of a numeric expression (numbers, ``tensor(x)``, + - * / **), else None."""
    text = _TENSOR.sub(r"\1", text).strip()
    while text.count("(") != text.count(")"):  # a side of "(a < b and ...)": drop the unmatched paren
        text = text[1:] if text.count("(") > text.count(")") else text[:-1]
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            a, b = value(node.left), value(node.right)
            return None if a is None or b is None else _ARITH[type(node.op)](a, b)
        return None

    return value(tree)


def comparisons(explanation: str) -> list[tuple[str, float, float]]:
    """``(kind, observed, bound)`` for each numeric comparison on the first line of an explanation."""
    first = explanation.split("\n", 1)[0]
    found = []
    for part in re.split(r"\band\b|\bor\b", first):
        sides = _COMPARE.split(part)
        if len(sides) != 3:  # no comparison, or a chained one
            continue
        lhs, op, rhs = _number(sides[0]), sides[1], _number(sides[2])
        if lhs is not None and rhs is not None:
            found.append((_OPS[op], lhs, rhs))
    return found


class _Log:
    def __init__(self, path: str):
        self.path = path
        self.test = "<collection>"

    def write(self, where: str, kind: str, observed: float, bound: float, source: str = "library") -> None:
        record = {"test": self.test, "where": where, "kind": kind, "observed": observed, "bound": bound, "source": source}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _caller() -> str | None:
    """``file:line`` of the innermost frame in a test file, or None when no test file called."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_TESTS) and not name.endswith("margins.py"):
            return f"{os.path.relpath(name, _TESTS)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _share_of_allowance(actual, expected, rtol: float, atol: float) -> float:
    import torch

    a = torch.as_tensor(actual).detach().cpu().double()
    b = torch.as_tensor(expected).detach().cpu().double()
    if a.numel() == 0:
        return 0.0
    a, b = torch.broadcast_tensors(a, b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    excess = (a - b).abs()[finite] / (atol + rtol * b.abs()[finite])
    return float(excess.max()) if excess.numel() else 0.0


def _wrap(log: _Log, fn, default_rtol: float, default_atol: float, keyword_rtol="rtol", keyword_atol="atol"):
    def wrapped(actual, expected, *args, **kwargs):
        where = _caller()
        result = fn(actual, expected, *args, **kwargs)
        if where is not None and result is not False:  # False: a check that two things differ
            rtol = kwargs.get(keyword_rtol, args[0] if args else None)
            atol = kwargs.get(keyword_atol, args[1] if len(args) > 1 else None)
            rtol = default_rtol if rtol is None else rtol
            atol = default_atol if atol is None else atol
            try:
                share = _share_of_allowance(actual, expected, rtol, atol)
            except Exception:  # a comparison of non-numeric objects: nothing to measure
                return result
            if rtol > 0 or atol > 0:
                log.write(where, "upper", share, 1.0)
        return result

    return wrapped


def _assert_close_defaults(actual, expected) -> tuple[float, float]:
    import torch

    dtype = torch.as_tensor(expected).dtype
    return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float64: (1e-7, 1e-7)}.get(dtype, (1.3e-6, 1e-5))


def install(log: _Log) -> None:
    """Record every library comparison called from a test file (see the module docstring)."""
    import numpy as np
    import torch

    original = torch.testing.assert_close

    def assert_close(actual, expected, *args, **kwargs):
        where = _caller()
        original(actual, expected, *args, **kwargs)
        if where is None or not hasattr(expected, "dtype") or not (torch.is_tensor(expected) and expected.is_floating_point()):
            return
        rtol, atol = _assert_close_defaults(actual, expected)
        rtol, atol = kwargs.get("rtol", rtol), kwargs.get("atol", atol)
        if rtol > 0 or atol > 0:
            log.write(where, "upper", _share_of_allowance(actual, expected, rtol, atol), 1.0)

    torch.testing.assert_close = assert_close
    torch.allclose = _wrap(log, torch.allclose, 1e-5, 1e-8)
    torch.Tensor.allclose = _wrap(log, torch.Tensor.allclose, 1e-5, 1e-8)
    np.testing.assert_allclose = _wrap(log, np.testing.assert_allclose, 1e-7, 0.0)
    np.allclose = _wrap(log, np.allclose, 1e-5, 1e-8)


class Plugin:
    """pytest plugin: registered by conftest.py when ``MHLA_MARGINS`` names a file."""

    def __init__(self, path: str):
        self.log = _Log(path)
        install(self.log)

    def pytest_runtest_setup(self, item):
        self.log.test = item.nodeid

    def pytest_assertion_pass(self, item, lineno, orig, expl):
        where = f"{os.path.relpath(str(item.path), _TESTS)}:{lineno}"
        for kind, observed, bound in comparisons(expl):
            self.log.write(where, kind, observed, bound, "assert")


def margin(kind: str, observed: float, bound: float) -> float:
    """``bound / observed`` for an upper bound, ``observed / bound`` for a lower one (inf when exact)."""
    if kind == "upper":
        return math.inf if observed <= 0 else bound / observed
    return math.inf if bound <= 0 else observed / bound


def _is_tolerance(record: dict) -> bool:
    """A comparison of a computed error with a tolerance, not a count, a budget or a negative check.

    Library comparisons are recorded with bound 1 (the share of their allowance); a share above 1 is a
    ``not torch.allclose(...)`` (a check that two things differ), which is no tolerance. Parsed
    upper bounds above 0.1 are limits of another kind (budgets, counts, ratios).
    """
    observed, bound = float(record["observed"]), float(record["bound"])
    if observed.is_integer() and bound.is_integer():
        return False
    if record.get("source") == "assert" and record["kind"] == "upper":
        return bound <= 0.1
    if record["kind"] == "upper" and bound == 1.0:
        return observed <= 1.0
    return record["kind"] == "lower" or bound <= 0.1


def merge(paths: list[str]) -> dict[tuple[str, str, str], dict]:
    """Each comparison's worst record over the runs, keyed by (test, where, kind)."""
    worst: dict[tuple[str, str, str], dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if not all(math.isfinite(record[k]) for k in ("observed", "bound")):
                continue
            if not _is_tolerance(record):
                continue
            key = (record["test"], record["where"], record["kind"])
            record["margin"] = margin(record["kind"], record["observed"], record["bound"])
            if key not in worst or record["margin"] < worst[key]["margin"]:
                worst[key] = record
    return worst


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Merge tolerance-audit logs; print the tightest margins.")
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--kind", choices=["upper", "lower", "all"], default="upper")
    args = parser.parse_args(argv)
    records = [r for r in merge(args.logs).values() if args.kind == "all" or r["kind"] == args.kind]
    records.sort(key=lambda r: r["margin"])
    print(f"{len(records)} comparisons; {sum(r['margin'] < 10 for r in records)} with a margin under 10")
    print("| margin | observed | bound | where | test |\n|---:|---:|---:|---|---|")
    for r in records[: args.top]:
        print(f"| {r['margin']:.3g} | {r['observed']:.3g} | {r['bound']:.3g} | {r['where']} | {r['test']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
