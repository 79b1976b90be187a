"""The package's import structure, read statically (``ast``) from every module of ``mhla_diffusers``:
module-level and function-level imports alike (``if TYPE_CHECKING:`` blocks excluded: they never run),
``from mhla_diffusers import NAME`` / ``mhla_diffusers.NAME`` resolved to the module the root's lazy
``_EXPORTS`` table names.

- ``ops`` is framework-free: nothing of ``mhla_diffusers`` outside ``ops`` (but the standard-library-only
  ``mhla_diffusers.env``, the one reader of environment flags), nothing of diffusers & co.;
- no cycle among the package's modules, and no package ``__init__`` importing a module that imports back
  into that package (importing any submodule runs the ``__init__`` first: a cycle through Python itself);
- ``diagnostics`` does not import ``training``, even indirectly;
- private names (``_foo``) imported across modules: only the listed ones, left in modules being rewritten.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

PACKAGE = "mhla_diffusers"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
FRAMEWORKS = {"diffusers", "transformers", "accelerate", "peft"}

# Private names imported across modules: none may be (the list may only shrink).
PRIVATE_IMPORTS_LEFT: set = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def _modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}``."""
    return {_module_name(p): (p, p.name == "__init__.py") for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
    return name.lstrip("_") == "TYPE_CHECKING"


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


@lru_cache(maxsize=None)
def _lazy_exports() -> dict[str, str]:
    """The root package's ``_EXPORTS``: public name -> module."""
    tree = ast.parse(_modules()[PACKAGE][0].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("mhla_diffusers/__init__.py has no _EXPORTS table")


@lru_cache(maxsize=None)
def _imports() -> dict[str, dict]:
    """Per module: ``{"internal": {target module}, "external": {top-level package}, "private": {(source, name)}}``."""
    modules, exports, out = _modules(), _lazy_exports(), {}
    for name, (path, is_pkg) in modules.items():
        internal, external, private = set(), set(), set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    (internal if alias.name.split(".")[0] == PACKAGE else external).add(
                        alias.name if alias.name.split(".")[0] == PACKAGE else alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if base == "__future__":
                    continue
                if base.split(".")[0] != PACKAGE:
                    external.add(base.split(".")[0])
                    continue
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        internal.add(f"{base}.{alias.name}")
                        continue
                    internal.add(exports.get(alias.name, base) if base == PACKAGE else base)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.add((base, alias.name))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == PACKAGE:
                if node.attr in exports:  # mhla_diffusers.NAME after `import mhla_diffusers`
                    internal.add(exports[node.attr])
        internal.discard(name)
        out[name] = {"internal": internal, "external": external - {""}, "private": private}
    return out


def _reachable(start: str) -> set[str]:
    graph, seen, stack = _imports(), set(), [start]
    while stack:
        for target in graph.get(stack.pop(), {"internal": ()})["internal"]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_reader_sees_function_level_imports():
    """The check can fail: it sees an import inside a function (the Triton backend's lazy kernels)."""
    assert "mhla_diffusers.ops.triton_ops" in _imports()["mhla_diffusers.ops.triton_backend"]["internal"]
    assert "mhla_diffusers.apply" in _imports()["mhla_diffusers.checkpoint.loading"]["internal"]  # module level too


def test_ops_is_framework_free():
    bad = {}
    for name, imports in _imports().items():
        if not _in(name, "mhla_diffusers.ops"):
            continue
        outside = {t for t in imports["internal"] if not _in(t, "mhla_diffusers.ops") and t != "mhla_diffusers.env"}
        frameworks = imports["external"] & FRAMEWORKS
        if outside or frameworks:
            bad[name] = sorted(outside | frameworks)
    assert not bad, bad
    env = _imports()["mhla_diffusers.env"]
    assert not env["internal"] and env["external"] <= set(sys.stdlib_module_names), env


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {name: sorted(t for t in imports["internal"] if t in _imports()) for name, imports in _imports().items()}
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle():
    assert _cycles() == []


def test_no_package_init_imports_back_into_its_package():
    bad = {}
    for name, (_, is_pkg) in _modules().items():
        if not is_pkg:
            continue
        for target in _imports()[name]["internal"]:
            if not _in(target, name) and any(_in(m, name) for m in _reachable(target) | {target}):
                bad.setdefault(name, []).append(target)
    assert not bad, bad


def test_diagnostics_does_not_import_training():
    bad = {name: sorted(m for m in _reachable(name) if _in(m, "mhla_diffusers.training"))
           for name in _imports() if _in(name, "mhla_diffusers.diagnostics")}
    assert not any(bad.values()), bad


def test_selection_is_built_on_models_not_the_reverse():
    """Nothing in models/ reaches selection/, function-level imports included; what chooses the layers
    (``mhla_diffusers/apply.py``: ``apply_mhla``) sits above both, and selection/ builds on the installer."""
    reaching = {name: sorted(m for m in _reachable(name) if _in(m, "mhla_diffusers.selection"))
                for name in _imports() if _in(name, "mhla_diffusers.models")}
    assert not any(reaching.values()), {k: v for k, v in reaching.items() if v}
    assert "mhla_diffusers.models.installer" in _reachable("mhla_diffusers.selection.sensitivity")
    assert {"mhla_diffusers.selection.auto", "mhla_diffusers.models.installer"} <= _imports()["mhla_diffusers.apply"]["internal"]


def test_no_module_over_600_lines():
    """A module one reads in a sitting: none of the package's files passes 600 lines."""
    long = {name: n for name, (path, _) in _modules().items() if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long


def test_private_names_imported_across_modules():
    found = {(name, source, private) for name, imports in _imports().items() for source, private in imports["private"]}
    assert found <= PRIVATE_IMPORTS_LEFT, sorted(found - PRIVATE_IMPORTS_LEFT)
