"""The documentation site (mkdocs.yml) builds with --strict, and docs/api.md documents every public name.

--strict turns every warning into a failure: a link to a missing page or anchor in docs/, a docstring
griffe cannot parse (a documented parameter the signature lacks, a malformed Raises section, ...).
The build takes about 3 s (2 cores).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import mhla_diffusers

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 300


def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a warning of ours
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
           "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + ("\n".join(warnings) or output)
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def _api_entries() -> dict[str, str]:
    """``{name: dotted path}`` of the ``::: path`` entries of docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text()
    paths = re.findall(r"^:::\s+(\S+)\s*$", text, flags=re.MULTILINE)
    return {path.rsplit(".", 1)[1]: path for path in paths}


def test_every_public_name_has_a_reference_entry():
    entries = _api_entries()
    missing = [name for name in mhla_diffusers.__all__ if name not in entries]
    assert not missing, f"docs/api.md has no ::: entry for {missing}"
    # each entry names the module that defines the object: griffe reads the source statically and does
    # not follow the package's lazy __getattr__ (the defining module is also what a reader can open)
    wrong = {}
    for name in mhla_diffusers.__all__:
        module, _ = entries[name].rsplit(".", 1)
        obj = getattr(mhla_diffusers, name)
        if getattr(importlib.import_module(module), name, None) is not obj or obj.__module__ != module:
            wrong[name] = (entries[name], f"{obj.__module__}.{name}")
    assert not wrong, f"docs/api.md entries not at the defining module (entry, defining path): {wrong}"
