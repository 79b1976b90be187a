"""The command-line scripts' ``--help`` and their pages agree: every long option a script's ``--help``
shows (``--help`` aside) is named on the script's page as ``--option`` text somewhere (prose, a table, a
command). The other direction, every option a page's commands use exists: tests/docs/test_examples.py.
"""

from __future__ import annotations

import re

import pytest
from examples import ROOT, script_options

# script -> the page that documents its options (one line per script)
SCRIPT_PAGES = {
    "conversion/convert.py": "docs/conversion.md",
    "finetune/train.py": "docs/training.md",
    "finetune/retrofit.py": "docs/training.md",
    "benchmarks/bench_context_memory.py": "docs/training.md",
    "pipelines/generate.py": "docs/generation.md",
    "demo/run_study.py": "docs/study.md",
    "benchmarks/bench_ops.py": "docs/performance.md",
    "benchmarks/bench_pipeline.py": "docs/performance.md",
    "benchmarks/bench_blocks.py": "docs/performance.md",
    "benchmarks/gpu_check.py": "docs/triton.md",
    "benchmarks/gpu_step.py": "docs/triton.md",
    "benchmarks/kernel_report.py": "docs/performance.md",
    "benchmarks/diagnose.py": "docs/diagnostics.md",
    "benchmarks/bench_vace.py": "docs/families/wan-vace.md",
}


def named(option: str, text: str) -> bool:
    """``--option`` occurs in ``text`` as itself (``--layers`` is not named by ``--layers-2``)."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@pytest.mark.parametrize("script", SCRIPT_PAGES)
def test_every_option_is_on_its_page(script):
    page = ROOT / SCRIPT_PAGES[script]
    if not page.is_file():
        pytest.fail(f"{SCRIPT_PAGES[script]} does not exist: it is the page of {script}'s options", pytrace=False)
    text = page.read_text(encoding="utf-8")
    missing = [option for option in script_options(script) if not named(option, text)]
    assert not missing, f"{SCRIPT_PAGES[script]} does not name these options of {script} --help: {', '.join(missing)}"


def test_every_script_has_long_options():
    """The check above is not vacuous: each script's --help is read and shows options."""
    for script in SCRIPT_PAGES:
        assert script_options(script), script
