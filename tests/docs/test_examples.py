"""Every code example in README.md and docs/**/*.md runs here or is checked here: a stale example fails.

The convention the pages are written to (machinery: tests/docs/examples.py):

A. Fenced ```python blocks run. All python blocks of one page run in order in one shared namespace (a
   page reads like a notebook: later blocks may use names defined earlier), in a fresh temporary working
   directory per page. A block whose first line starts with ``# not run:`` is not run; the text after it
   is the reason (required), reported as a skipped subtest "<page>:<line>: <reason>". Blocks with other
   info strings (```text, ```yaml, ```console, plain ```) are not python. One test per page (id: the
   page's path in the repository, e.g. ``README.md``, ``docs/usage.md``); a failing block fails it with the
   page line that failed, the block's line and the traceback, and the page's later blocks are not run.
B. The working directory of a page holds what its examples may reference by relative path: ``demo/`` (a
   link to the repository's demo/, a real small pretrained DiT pipeline at demo/base_dit; the links are
   ``REPO_LINKS`` of tests/docs/examples.py) and the tiny model folders of its ``MODEL_FOLDERS``
   (``Sana_600M_512px_diffusers``, ``Wan2.1-T2V-1.3B-Diffusers``, ``Wan2.1-I2V-14B-480P-Diffusers``,
   ``Wan2.2-T2V-A14B-Diffusers``, ``Wan2.2-I2V-A14B-Diffusers``, ``Wan2.2-TI2V-5B-Diffusers``): diffusers
   pipeline folders (``save_pretrained``), built once per session, copied in when the page's runnable
   python blocks name them. Nothing is downloaded (HF_HUB_OFFLINE=1): a Hub id fails. The namespace starts
   empty but for ``__name__ = "__main__"`` (examples import what they use); ``torch.manual_seed(0)``
   before each page; matplotlib's backend is Agg. Each page runs in a fresh interpreter (forked from a
   server that has imported torch, diffusers and transformers): what one page imports or registers
   (``import mhla_diffusers.autoencoder``, a hook) cannot make another page pass.
C. Fenced ```bash / ```sh / ```shell blocks are checked, not run. Each command (``\\`` continuations
   joined, comments and blank lines dropped, split on ``&&`` ``||`` ``;`` ``|``, leading ``VAR=value``
   assignments dropped):
   * ``python <path>.py ...``, ``accelerate launch [options] <path>.py ...``, ``torchrun [options]
     <path>.py ...``: the script exists in the repository and every ``--option`` (``--option=value``,
     ``[--option 8]`` placeholders too) after it is an option of the script's ``--help``; the launcher's
     own options are options of ``accelerate launch`` / ``torchrun``;
   * ``make <target>``: a target of the Makefile;
   * ``pip install ...`` (or ``python -m pip``): each extra of ``.[extra]`` / ``mhla_diffusers[extra]`` is
     in pyproject.toml's optional-dependencies;
   * ``python -m <module>``: a module of ``PYTHON_MODULES``; any other command: one of ``ALLOWED_COMMANDS``
     (an unknown one fails, saying to add it there or rewrite the example).
D. Fenced ```yaml blocks must parse with ``yaml.safe_load`` (several ``---`` documents allowed).
   C and D: one test per page (``test_checked_examples``), listing every problem with its page line.

The other direction, every option of a script's ``--help`` named on its page: tests/docs/test_cli_pages.py.
"""

from __future__ import annotations

import pytest
import yaml
from examples import (
    PYTHON,
    REPO_LINKS,
    ROOT,
    SHELL,
    YAML,
    ModelFolders,
    blocks,
    check_command,
    not_run_reason,
    page_id,
    pages,
    run_page,
    shell_commands,
)

PAGES = pages()


def _with(langs) -> list:
    return [pytest.param(page, id=page_id(page)) for page in PAGES if blocks(page, langs)]


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory) -> ModelFolders:
    return ModelFolders(tmp_path_factory.mktemp("doc_models"))


def _skipper(request):
    """Report a not-run block as a skipped subtest (pytest >= 9), else collect it for one skip at the end."""
    try:
        subtests = request.getfixturevalue("subtests")
    except pytest.FixtureLookupError:
        subtests = None
    pending: list[str] = []

    def skip(where: str, reason: str):
        if subtests is None:
            pending.append(f"{where} ({reason})")
            return
        with subtests.test():  # the page and line go in the reason: pytest's summary folds skips by reason
            pytest.skip(f"{where}: {reason}")

    return skip, pending


@pytest.mark.parametrize("page", _with(PYTHON))
def test_python_examples(page, model_folders, tmp_path, request):
    runnable = [b for b in blocks(page, PYTHON) if not_run_reason(b) is None]
    for name in REPO_LINKS:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=(ROOT / name).is_dir())
    model_folders.install("".join(b.code for b in runnable), tmp_path)
    failure, skipped = run_page(page, tmp_path)
    skip, pending = _skipper(request)
    for line, reason in skipped:
        skip(f"{page_id(page)}:{line}", reason)
    if failure:
        pytest.fail(failure, pytrace=False)
    if pending:
        pytest.skip(f"ran {len(runnable)} block(s); not run: " + "; ".join(pending))


@pytest.mark.parametrize("page", _with(SHELL | YAML))
def test_checked_examples(page):
    """C and D: the page's shell commands and YAML blocks (every problem, each with its page line)."""
    problems = []
    for block in blocks(page, SHELL | YAML):
        if block.lang in YAML:
            try:
                list(yaml.safe_load_all(block.code))
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                line = block.line + 1 + mark.line if mark is not None else block.line
                problems.append(f"{page_id(page)}:{line}: the yaml block at line {block.line} does not parse: {exc}")
            continue
        for line, argv in shell_commands(block):
            found = [argv] if isinstance(argv, str) else check_command(argv)
            problems += [f"{page_id(page)}:{line}: {problem}" for problem in found]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
