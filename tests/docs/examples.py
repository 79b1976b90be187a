"""The machinery of the documentation tests (tests/docs/test_examples.py, tests/docs/test_cli_pages.py):
finding the pages and their fenced code blocks, the tiny model folders the examples may load, running a
page's python blocks, and checking shell commands against the scripts' ``--help``.

The convention itself is stated in tests/docs/test_examples.py. Point a private run at other pages with
``MHLA_DOC_PAGES=path/a.md:path/folder pytest tests/docs`` (files or folders of ``*.md``, ``os.pathsep``
separated); without it the pages are :data:`PAGE_GLOBS` under the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import sys
import time
import tomllib
import traceback
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]

# -- pages and blocks ----------------------------------------------------------------------------------
PAGE_GLOBS = ("README.md", "docs/**/*.md")
PAGES_ENV = "MHLA_DOC_PAGES"

PYTHON = frozenset({"python", "py", "python3"})
SHELL = frozenset({"bash", "sh", "shell"})
YAML = frozenset({"yaml", "yml"})
NOT_RUN = "# not run:"


def pages() -> list[Path]:
    """The pages the tests scan: ``$MHLA_DOC_PAGES`` if set, else :data:`PAGE_GLOBS` under :data:`ROOT`."""
    override = os.environ.get(PAGES_ENV)
    if override:
        found: list[Path] = []
        for entry in filter(None, override.split(os.pathsep)):
            path = Path(entry).resolve()
            found += sorted(path.rglob("*.md")) if path.is_dir() else [path]
        return found
    return sorted({p for pattern in PAGE_GLOBS for p in ROOT.glob(pattern) if p.is_file()}, key=page_id)


def page_id(path: Path) -> str:
    """The page's path relative to the repository (``README.md``, ``docs/usage.md``), else as given."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Block:
    """One fenced code block: ``lang`` (first word of the info string, lower case; ``""`` for a plain
    fence), ``line`` (1-based line of the opening fence in the page), ``code`` (the content, dedented by
    the fence's indentation, so blocks inside list items and admonitions read as written)."""

    lang: str
    line: int
    code: str


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def blocks(path: Path, langs: frozenset[str] | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order (only those of ``langs`` if given)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        lang = info.split()[0].strip("{}.").lower() if info else ""
        found.append(Block(lang, i + 1, "\n".join(body) + "\n"))
        i = j + 1
    return [b for b in found if langs is None or b.lang in langs]


def not_run_reason(block: Block) -> str | None:
    """The text after ``# not run:`` when the block's first line starts with it, else ``None``."""
    first = block.code.lstrip("\n").splitlines()[0].strip() if block.code.strip() else ""
    return first[len(NOT_RUN):].strip() if first.startswith(NOT_RUN) else None


# -- what a page's examples may load by relative path --------------------------------------------------
REPO_LINKS = ("demo", "finetune")  # repository folders linked into each page's working directory (demo/base_dit, the configs)


def _tiny(module: str, builder: str, **kwargs):
    return lambda: getattr(import_module(module), builder)(**kwargs)


# folder name (as the examples write it) -> a builder of the tiny pipeline saved there (tests/helpers*.py).
# SANA: sample_size 16 as Sana_600M_512px (resolution binning then uses the 512-px bins, so a call with
# the default 1024 x 1024 runs at 512 x 512 latent pixels / 4: a second).
MODEL_FOLDERS = {
    "Sana_600M_512px_diffusers": _tiny("helpers_sana", "tiny_sana_pipeline", sample_size=16),
    "Wan2.1-T2V-1.3B-Diffusers": _tiny("helpers_wan", "tiny_wan_pipeline"),
    "Wan2.1-I2V-14B-480P-Diffusers": _tiny("helpers_wan", "tiny_wan_i2v_pipeline"),
    "Wan2.2-T2V-A14B-Diffusers": _tiny("helpers_wan", "tiny_wan22_pipeline", kind="t2v"),
    "Wan2.2-I2V-A14B-Diffusers": _tiny("helpers_wan", "tiny_wan22_pipeline", kind="i2v"),
    "Wan2.2-TI2V-5B-Diffusers": _tiny("helpers_wan", "tiny_wan22_pipeline", kind="ti2v"),
    "SANA-Video_2B_480p_diffusers": _tiny("helpers_sana_video", "tiny_sana_video_pipeline"),
    "Wan2.1-VACE-1.3B-diffusers": _tiny("helpers_wan_vace", "tiny_wan_vace_pipeline"),
}


class ModelFolders:
    """Builds each :data:`MODEL_FOLDERS` entry at most once (``save_pretrained`` into ``cache``)."""

    def __init__(self, cache: Path):
        self.cache = Path(cache)
        self.seconds: dict[str, float] = {}

    def get(self, name: str) -> Path:
        folder = self.cache / name
        if not folder.is_dir():
            start = time.perf_counter()
            partial = self.cache / f".{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            MODEL_FOLDERS[name]().save_pretrained(partial)
            partial.rename(folder)
            self.seconds[name] = time.perf_counter() - start
        return folder

    def install(self, code: str, cwd: Path) -> list[str]:
        """Copy every folder whose name ``code`` mentions into ``cwd``; returns the names."""
        named = [name for name in MODEL_FOLDERS if name in code]
        for name in named:
            shutil.copytree(self.get(name), Path(cwd) / name, symlinks=True)
        return named


# -- running python blocks -----------------------------------------------------------------------------
_OFFLINE = re.compile(r"offline|huggingface\.co|LocalEntryNotFound|not fully cached locally|outgoing traffic", re.I)


def run_block(block: Block, page: Path, namespace: dict) -> str | None:
    """Run one python block in ``namespace``; ``None`` on success, else the failure message (the page
    line that failed, the block's line, the traceback from the block's frame on)."""
    filename = str(Path(page).resolve())
    try:
        code = compile("\n" * block.line + block.code, filename, "exec")  # line numbers are the page's
        exec(code, namespace)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001  (SystemExit from an example's main() included)
        tb = traceback.TracebackException.from_exception(exc)
        frames = list(tb.stack)
        ours = [k for k, f in enumerate(frames) if f.filename == filename]
        line = frames[ours[-1]].lineno if ours else block.line
        if ours:
            tb.stack = traceback.StackSummary.from_list(frames[ours[0]:])
        hint = ""
        if any(_OFFLINE.search(f"{type(e).__name__}: {e}") for e in _chain(exc)):
            hint = (f"\n(the examples run offline: load demo/base_dit or a local folder named as in "
                    f"MODEL_FOLDERS of tests/docs/examples.py: {', '.join(MODEL_FOLDERS)})")
        return (f"{page_id(page)}:{line}: {type(exc).__name__}: {exc}\n"
                f"in the python block at line {block.line}{hint}\n\n" + "".join(tb.format()))
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (``__cause__``, ``__context__``)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def run_page(page: Path, cwd: Path) -> tuple[str | None, list[tuple[int, str]]]:
    """Run a page's python blocks in order, in one namespace, in ``cwd``, in a FRESH interpreter (as a reader
    would: nothing another page imported or registered is there). Returns ``(failure or None, [(line,
    reason)] of the blocks not run)``; an empty ``# not run:`` reason is a failure."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))  # imported once in the server; each page forks from it
    with context.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_run_page_here, (str(page), str(cwd)))


_PRELOAD = ("torch", "numpy", "diffusers", "transformers", "safetensors", "PIL.Image")


def _run_page_here(page: str, cwd: str) -> tuple[str | None, list[tuple[int, str]]]:
    import torch

    os.chdir(cwd)
    os.environ["MPLBACKEND"] = "Agg"
    sys.argv = [page]
    namespace: dict = {"__name__": "__main__"}
    skipped: list[tuple[int, str]] = []
    torch.manual_seed(0)
    for block in blocks(Path(page), PYTHON):
        reason = not_run_reason(block)
        if reason == "":
            return f"{page_id(Path(page))}:{block.line}: give the reason after `# not run:`", skipped
        if reason is not None:
            skipped.append((block.line, reason))
            continue
        failure = run_block(block, Path(page), namespace)
        if failure:
            return failure, skipped
    return None, skipped


# -- shell commands ------------------------------------------------------------------------------------
# commands the docs may show that are not checked further; None: allowed, a string: refused with it.
ALLOWED_COMMANDS: dict[str, str | None] = {
    "cd": None, "ls": None, "export": None, "mkdocs": None, "git": None, "bash": None, "cat": None, "hf": None,
    "huggingface-cli": "the huggingface_hub that transformers 5 requires (>= 1.0) has no huggingface-cli: write `hf ...`",
}
PYTHON_MODULES = frozenset({"pytest", "mkdocs"})  # `python -m X` allowed unchecked (`-m pip`: see pip)
ACCELERATE_SUBCOMMANDS = frozenset({"config", "env"})  # besides `launch`, which is checked
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
_SEPARATORS = frozenset({"&&", "||", ";", "|", "&"})
_REDIRECT = re.compile(r"\d*(>>?|<|&>)")


def shell_commands(block: Block) -> list[tuple[int, list[str] | str]]:
    """``(page line, argv)`` for each command of a shell block: ``\\`` continuations joined, comments and
    blank lines dropped, split on ``&&`` ``||`` ``;`` ``|``, redirections dropped. A line shlex cannot
    split gives ``(line, message)``."""
    logical: list[tuple[int, str]] = []
    start, parts = None, []
    for k, raw in enumerate(block.code.splitlines()):
        number = block.line + 1 + k
        if start is None:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start = number
        if raw.rstrip().endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        logical.append((start, " ".join(parts + [raw])))
        start, parts = None, []
    if parts:
        logical.append((start, " ".join(parts)))
    commands: list[tuple[int, list[str] | str]] = []
    for number, text in logical:
        try:
            tokens = shlex.split(_strip_comment(text))
        except ValueError as exc:
            commands.append((number, f"cannot split the command ({exc}): {text.strip()}"))
            continue
        argv: list[str] = []
        skip = False
        for token in tokens:
            if skip:
                skip = False
                continue
            if token.endswith(";") and token != ";":
                argv.append(token[:-1])
                token = ";"
            if token in _SEPARATORS:
                if argv:
                    commands.append((number, argv))
                argv = []
            elif _REDIRECT.fullmatch(token):
                skip = True  # its target follows
            elif _REDIRECT.match(token):
                continue  # 2>&1, >file
            else:
                argv.append(token)
        if argv:
            commands.append((number, argv))
    return commands


def _strip_comment(text: str) -> str:
    """``text`` up to its comment, as bash reads it: a ``#`` that starts a word, outside quotes."""
    quote, escaped = None, False
    for k, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (k == 0 or text[k - 1].isspace()):
            return text[:k]
    return text


def check_command(argv: list[str]) -> list[str]:
    """What is wrong with one shell command of the docs (an empty list: nothing)."""
    while argv and _ENV.match(argv[0]):
        argv = argv[1:]
    if not argv:
        return []
    command, args = argv[0], argv[1:]
    name = Path(command).name
    if _PYTHON.match(name):
        return _check_python(args)
    if name == "accelerate":
        if args[:1] == ["launch"]:
            return _check_launcher("accelerate launch", args[1:])
        if args[:1] and args[0] in ACCELERATE_SUBCOMMANDS:
            return []
        return [f"`accelerate {' '.join(args[:1])}`: only `accelerate launch` (checked) and "
                f"{sorted(ACCELERATE_SUBCOMMANDS)} are known; add it to ACCELERATE_SUBCOMMANDS in tests/docs/examples.py"]
    if name == "torchrun":
        return _check_launcher("torchrun", args)
    if name == "make":
        return _check_make(args)
    if name in ("pip", "pip3"):
        return _check_pip(args)
    if name in ALLOWED_COMMANDS:
        refusal = ALLOWED_COMMANDS[name]
        return [f"`{name}`: {refusal}"] if refusal else []
    return [f"`{command}` is not a command the docs tests know: add it to ALLOWED_COMMANDS in "
            f"tests/docs/examples.py, or rewrite the example"]


def _check_python(args: list[str]) -> list[str]:
    k = 0
    while k < len(args):
        token = args[k]
        if token == "-m":
            module = args[k + 1] if k + 1 < len(args) else ""
            if module == "pip":
                return _check_pip(args[k + 2:])
            if module in PYTHON_MODULES:
                return []
            return [f"`python -m {module}`: not a module the docs tests know; add it to PYTHON_MODULES in "
                    f"tests/docs/examples.py, or run a script by its path"]
        if token == "-c":
            return ["`python -c`: put the code in a ```python block (those run) or a script"]
        if token in ("-X", "-W"):
            k += 2
            continue
        if token.startswith("-"):
            k += 1
            continue
        return _check_script(token, args[k + 1:])
    return ["`python` without a script"]


def _options_given(args: list[str]) -> list[str]:
    """The ``--option`` names among ``args`` (``--x=v`` -> ``--x``; ``[--x 8]`` placeholders count)."""
    found = []
    for token in args:
        token = token.lstrip("[(").rstrip("])")
        if token == "--":
            break
        if token.startswith("--") and len(token) > 2:
            found.append(token.split("=", 1)[0])
    return found


def _check_script(script: str, args: list[str]) -> list[str]:
    path = (ROOT / script).resolve()
    if not path.is_relative_to(ROOT) or not path.is_file() or path.suffix != ".py":
        return [f"{script}: no such script in the repository"]
    rel = path.relative_to(ROOT).as_posix()
    try:
        known = set(script_options(rel, all_options=True))
    except Exception as exc:  # noqa: BLE001
        return [f"{rel} --help failed: {type(exc).__name__}: {exc}"]
    return [f"{rel}: {opt} is not an option of its --help" for opt in _options_given(args) if opt not in known]


def _check_launcher(launcher: str, args: list[str]) -> list[str]:
    script = next((k for k, t in enumerate(args) if t.endswith(".py")), None)
    if script is None:
        return [f"`{launcher}` without a script path (a .py file)"]
    known = launcher_options(launcher)
    problems = [f"`{launcher}`: {opt} is not one of its options" for opt in _options_given(args[:script]) if opt not in known]
    if any(t in ("-m", "--module") for t in args[:script]):
        problems.append(f"`{launcher} -m`: launch a script by its path")
    return problems + _check_script(args[script], args[script + 1:])


@lru_cache(maxsize=None)
def launcher_options(launcher: str) -> frozenset[str]:
    """The option strings of ``accelerate launch`` / ``torchrun`` (their parsers, built in-process)."""
    if launcher == "accelerate launch":
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
    elif launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    else:
        raise ValueError(launcher)
    return frozenset(s for action in parser._actions for s in action.option_strings)


@lru_cache(maxsize=None)
def script_help(rel: str) -> tuple[str, argparse.ArgumentParser]:
    """``(the --help text, its parser)`` of a repository script, from ``main(["--help"])`` in-process
    (cached per script)."""
    from helpers import load_script

    module = load_script(rel)
    printed: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help

    def record(self, file=None):
        printed.append(self)
        return original(self, file)

    out, err, code = io.StringIO(), io.StringIO(), None
    with mock.patch.object(argparse.ArgumentParser, "print_help", record), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main(["--help"])
        except SystemExit as exc:
            code = exc.code
    if code not in (0, None) or not printed:
        raise RuntimeError(f"main(['--help']) printed no help (exit {code}): {err.getvalue().strip()[-500:]}")
    return out.getvalue(), printed[-1]


def script_options(rel: str, all_options: bool = False) -> list[str]:
    """The long options a script's ``--help`` shows (``--help`` itself left out unless ``all_options``,
    which also includes short ones), in the help's order."""
    _, parser = script_help(rel)
    options = [s for action in parser._actions if action.help is not argparse.SUPPRESS for s in action.option_strings]
    return options if all_options else [s for s in options if s.startswith("--") and s != "--help"]


@lru_cache(maxsize=1)
def makefile_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([^\s#:=][^:=]*?)\s*::?(?!=)", line)
        if m:
            targets.update(t for t in m[1].split() if not t.startswith(".") and "$" not in t)
    return frozenset(targets)


def _check_make(args: list[str]) -> list[str]:
    problems, skip = [], False
    for token in args:
        if skip:
            skip = False
        elif token in ("-C", "-f", "-I", "-o", "-W", "--directory", "--file"):
            skip = True
        elif token.startswith("-") or _ENV.match(token):
            continue
        elif token not in makefile_targets():
            problems.append(f"`make {token}`: no such target in the Makefile ({', '.join(sorted(makefile_targets()))})")
    return problems


@lru_cache(maxsize=1)
def project_extras() -> frozenset[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return frozenset(tomllib.load(f)["project"].get("optional-dependencies", {}))


def _check_pip(args: list[str]) -> list[str]:
    problems = []
    for token in args:
        m = re.fullmatch(r"(?P<base>[^\[\]\s]*)\[(?P<extras>[^\]]*)\]", token)
        if not m:
            continue
        base = m["base"]
        if base in ("mhla_diffusers", "mhla-diffusers") or base.startswith((".", "/")) or base == "":
            for extra in (e.strip() for e in m["extras"].split(",")):
                if extra and extra not in project_extras():
                    problems.append(f"`pip install {token}`: pyproject.toml has no extra {extra!r} "
                                    f"({', '.join(sorted(project_extras()))})")
    return problems
