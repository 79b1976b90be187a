"""The operator is framework-free: importing ``mhla_diffusers.ops`` (or the package root, whose public
names load on first use) pulls in none of diffusers, transformers, accelerate, peft. Checked in a fresh
interpreter, where nothing else has imported them yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("diffusers", "transformers", "accelerate", "peft")


def _modules_after(*statements: str) -> list[list[str]]:
    """For each statement, run in order in one fresh interpreter: the HEAVY packages then in ``sys.modules``."""
    lines = ["import json, sys", "seen = []"]
    for statement in statements:
        lines += [statement, f"seen.append([m for m in {HEAVY!r} if m in sys.modules])"]
    lines.append("print(json.dumps(seen))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_operator_imports_no_framework():
    statements = [
        "import mhla_diffusers.ops",
        "import mhla_diffusers",
        "from mhla_diffusers import mhla_attention, BlockLayout, mixing_init, mhla_attention_reference, MixingMatrix",
        "import mhla_diffusers.ops.naive, mhla_diffusers.ops.compiled, mhla_diffusers.checkpoint.io",
    ]
    seen = _modules_after(*statements)
    assert seen == [[]] * len(statements), dict(zip(statements, seen))


def test_the_check_sees_a_framework():
    """The check can fail: the diffusers integration does import diffusers."""
    assert "diffusers" in _modules_after("import mhla_diffusers.models.processor")[0]
