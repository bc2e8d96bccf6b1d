"""The code base's layers, read from the source with ``ast``: the engine (``rewrite``) knows no rule,
``analysis`` imports no rule family, a family imports no other family, private names stay in their
package, modules import each other without cycles, files and functions stay short.

Each exception is listed in ALLOWED with the reason it is still there. The list may only shrink: an
entry that no longer breaks its rule fails the test too, so that it is removed once it is fixed."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "torchopt")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100

# (check, subject): why it is still allowed.
ALLOWED = {
    (
        "file over 800 lines",
        "torchopt.codemods.amp.autocast_insertion",
    ): "the autocast/GradScaler step analysis (models, optimizers, devices, regions of a training step) in one "
    "module; to be split into the file model and the step analysis",
    (
        "function over 100 lines",
        "torchopt.codemods.amp.autocast_insertion.analyse_step",
    ): "one pass over a training step that classifies every statement; to be split per statement kind",
    (
        "function over 100 lines",
        "torchopt.codemods.ddp.conversion_edits.convert",
    ): "the DataParallel/single-process to DDP conversion as one ordered list of edits",
    (
        "function over 100 lines",
        "torchopt.analysis.precheck.step_loops._collect",
    ): "the ast mirror of the step-loop scan; it must stay a superset of HotMap's walk, so it moves with it",
}


def _modules() -> dict[str, str]:
    """Module name -> path, for every source file of the package."""
    out = {}
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = os.path.relpath(path, ROOT)
    return out


MODULES = _modules()
TREES = {mod: ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), path) for mod, path in MODULES.items()}


def _is_package(mod: str) -> bool:
    return MODULES[mod].endswith("__init__.py")


def _package_of(mod: str) -> str:
    return mod if _is_package(mod) else mod.rpartition(".")[0]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def _imports(mod: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``mod`` that runs, at any
    depth (imports under ``if TYPE_CHECKING:`` never run and are left out)."""
    out = []
    skipped = _type_checking_only(TREES[mod])
    for node in ast.walk(TREES[mod]):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(mod).split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.append((f"{base}.{alias.name}", None, node.lineno))
                else:
                    out.append((base, alias.name, node.lineno))
    return out


def _owner(target: str) -> str | None:
    """The torchopt module an imported dotted name lives in (None outside torchopt)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _family(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "codemods" else None


def _layer(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else ""


def _violations() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    graph: dict[str, set[str]] = {mod: set() for mod in MODULES}
    for mod in MODULES:
        for target, name, line in _imports(mod):
            owner = _owner(target)
            if owner is None:
                continue
            graph[mod].add(owner)
            where = f"{MODULES[mod]}:{line}"
            if _layer(mod) == "rewrite" and _layer(owner) in ("codemods", "analysis"):
                found[("engine imports a rule", f"{mod} -> {owner}")] = where
            if _layer(mod) == "analysis" and _layer(owner) == "codemods":
                found[("analysis imports a rule family", f"{mod} -> {owner}")] = where
            if _family(mod) and _family(owner) and _family(mod) != _family(owner):
                found[("family imports another family", f"{mod} -> {owner}")] = where
            if name and name.startswith("_") and not name.startswith("__") and _package_of(owner) != _package_of(mod):
                found[("private name imported across packages", f"{mod} <- {owner}.{name}")] = where
    for cycle in _cycles(graph):
        found[("import cycle", " -> ".join(cycle))] = MODULES[cycle[0]]
    for mod, tree in TREES.items():
        lines = len(open(os.path.join(ROOT, MODULES[mod]), encoding="utf-8").read().splitlines())
        if lines > MAX_FILE_LINES:
            found[("file over 800 lines", mod)] = f"{MODULES[mod]} ({lines} lines)"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[("function over 100 lines", f"{mod}.{node.name}")] = (
                        f"{MODULES[mod]}:{node.lineno} ({length} lines)"
                    )
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w == v:
                continue
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_families_cycles_and_sizes():
    found = _violations()
    new = {key: where for key, where in found.items() if key not in ALLOWED}
    assert not new, "layout rules broken:\n" + "\n".join(f"  {c}: {s}  ({w})" for (c, s), w in sorted(new.items()))


def test_allow_list_only_shrinks():
    found = _violations()
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"fixed, so remove from ALLOWED: {stale}"
    assert len(ALLOWED) < 10


def test_each_rule_lives_in_a_module_named_after_it():
    from torchopt.rewrite.registry import all_rules

    misplaced = {
        code: rule.__module__
        for code, rule in all_rules().items()
        if rule.__module__.rsplit(".", 1)[1] != rule.name.replace("-", "_")
    }
    assert not misplaced
