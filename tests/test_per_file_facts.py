"""What torchopt learns about a file lives in one object per text (``rewrite/facts.py``), made by the
engine and dropped when the text is done: nothing of file N answers for file N+1, nothing of it stays
in memory, every rule of a pass shares the same facts, and no module keeps a cache of per-file facts
(checked on the source with ``ast``). Also: the nn.Module subclass scan the rules share."""

from __future__ import annotations

import ast
import gc
import os
import threading

import libcst as cst
import pytest

from torchopt.rewrite import config as config_mod, engine, facts as facts_module
from torchopt.rewrite.config import Settings
from torchopt.rewrite.facts import analysing, current_facts
from torchopt.rewrite.rule import Rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "torchopt")


def _train_script(marker: str) -> str:
    """A small training script that many rules' prefilters and several rules look at, naming
    ``marker`` so the objects built from it can be found in memory."""
    return (
        "import torch\nimport torch.nn as nn\n\n\n"
        f"class {marker}(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n\n\n"
        f"model = {marker}().cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scale = torch.zeros(3).cuda()\n"
        "for x in torch.randn(5, 2, 4):\n"
        "    opt.zero_grad()\n    loss = model(x.cuda()).sum()\n    loss.backward()\n    opt.step()\n"
        "    print(loss.item())\n"
    )


def _nodes_naming(marker: str) -> list[object]:
    """CPython ast and LibCST nodes still alive that spell ``marker``."""
    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if (isinstance(o, ast.Name) and o.id == marker)
        or (isinstance(o, ast.ClassDef) and o.name == marker)
        or (isinstance(o, cst.Name) and o.value == marker)
    ]


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_nothing_learnt_about_a_file_stays_in_memory_after_it_is_analysed():
    marker = "KeptAliveNet"
    text = _train_script(marker)
    settings = Settings()
    diags = engine.check_source(text, settings, "train.py").diagnostics
    fixed = engine.fix_source(text, settings, "train.py")
    assert {d.code for d in diags} >= {"TOP101"}  # LibCST parsed and rules ran, not just prefilters
    assert fixed.applied and fixed.text != text
    # The next file is analysed without any trace of the first one.
    engine.check_source(_train_script("OtherNet"), settings, "other.py")
    assert _nodes_naming(marker) == []
    assert current_facts() is None


def test_one_python_parse_per_text_shared_by_every_prefilter_and_the_syntax_check(monkeypatch):
    parsed: list[str] = []
    real_parse = ast.parse
    monkeypatch.setattr(
        facts_module.ast, "parse", lambda text, *a, **k: parsed.append(text) or real_parse(text, *a, **k)
    )
    first, second = _train_script("FirstNet"), _train_script("SecondNet")
    for text in (first, second, first):
        engine.check_source(text, Settings(), "train.py")
    assert parsed == [first, second, first]  # once each time a text is analysed, never reused across runs


def test_every_rule_of_a_pass_sees_the_same_facts_and_each_text_its_own(monkeypatch):
    seen: list[tuple[str, object]] = []

    class Recorder(Rule):
        code, name, family, message = "TOP997", "recorder", "test", "seen"

        def visit_Module(self, node: cst.Module) -> None:
            seen.append((type(self).__name__, self.ctx.facts))

    class OtherRecorder(Recorder):
        code = "TOP998"

    monkeypatch.setattr(config_mod, "all_rules", lambda: {"TOP997": Recorder, "TOP998": OtherRecorder})
    first, second = "x = 1\n", "y = 2\n"
    for text in (first, second):
        engine._run_rules(cst.parse_module(text), [Recorder, OtherRecorder], Settings(select=()), "f.py", text)
    assert [name for name, _ in seen] == ["Recorder", "OtherRecorder"] * 2
    (_, a1), (_, a2), (_, b1), (_, b2) = seen
    assert a1 is a2 and b1 is b2 and a1 is not b1
    assert a1.text == first and b1.text == second  # type: ignore[attr-defined]


def test_a_thread_never_sees_the_text_another_thread_is_analysing():
    inside = threading.Event()
    release = threading.Event()
    other_view: list[object] = []

    def look() -> None:
        inside.wait(5)
        other_view.append(current_facts())
        release.set()

    worker = threading.Thread(target=look)
    worker.start()
    with analysing("import torch\n") as facts:
        assert current_facts() is facts
        inside.set()
        release.wait(5)
    worker.join(5)
    assert other_view == [None]


# ---------------------------------------------------------------- no module-level per-file caches
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "__setitem__",
}

# name -> why a module-level container that functions fill is not a per-file cache. May only shrink.
ALLOWED_MODULE_STATE = {
    "torchopt.rewrite.metadata._FIELDS": "field names per LibCST node class: the same for every file",
    "torchopt.rewrite.metadata._ORDER": "children order per node class and set of fields: the same for every file",
    "torchopt.rewrite.metadata._KIND": "node / sequence / other per Python type: the same for every file",
    "torchopt.rewrite.fastvisit._PLAN": "visit order per node class and field kinds: the same for every file",
    "torchopt.rewrite.fastvisit._FIELDS": "field names per LibCST node class: the same for every file",
    "torchopt.rewrite.fastvisit._KIND": "node / sequence / other per Python type: the same for every file",
    "torchopt.rewrite.fastvisit._GETTERS": "field getters per LibCST node class: the same for every file",
    "torchopt.rewrite.fastvisit._UNIFORM": "per visitor class: the same for every file",
    "torchopt.rewrite.fastvisit._CLASS_PLAN": "per node class: the same for every file",
    "torchopt.rewrite.fastvisit._HOOKS": "which hooks a visitor class defines (weak keys): the same for every file",
    "torchopt.rewrite.fastvisit._TABLES": "dispatch tables per visitor class (weak keys): the same for every file",
    "torchopt.rewrite.fastvisit._VISITOR_NAMES": "visitor method names per visitor class (weak keys): the same for every file",
    "torchopt.rewrite.speedups._UNDO": "how to undo the LibCST speed-ups installed in this process",
    "torchopt.rewrite.budget._process_budget": "this process's memory budget, set once per worker",
}


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id
        in {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakValueDictionary", "WeakKeyDictionary"}
    )


def _mutated_module_state() -> dict[str, str]:
    """'module.NAME' -> how a function changes it, for module-level containers that functions fill,
    and every ``global`` rebinding."""
    found: dict[str, str] = {}
    for folder, _dirs, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            containers = set()
            for stmt in tree.body:
                targets = (
                    stmt.targets
                    if isinstance(stmt, ast.Assign)
                    else [stmt.target]
                    if isinstance(stmt, ast.AnnAssign)
                    else []
                )
                if targets and _is_container(stmt.value):  # type: ignore[union-attr]
                    containers |= {t.id for t in targets if isinstance(t, ast.Name)}
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                for n in ast.walk(fn):
                    if isinstance(n, ast.Global):
                        for name in n.names:
                            found[f"{mod}.{name}"] = f"line {n.lineno}: `global {name}` rebinds module state"
                    elif (
                        isinstance(n, ast.Subscript)
                        and isinstance(n.ctx, (ast.Store, ast.Del))
                        and isinstance(n.value, ast.Name)
                        and n.value.id in containers
                    ):
                        found[f"{mod}.{n.value.id}"] = f"line {n.lineno}: item assignment"
                    elif (
                        isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Attribute)
                        and n.func.attr in _MUTATORS
                        and isinstance(n.func.value, ast.Name)
                        and n.func.value.id in containers
                    ):
                        found[f"{mod}.{n.func.value.id}"] = f"line {n.lineno}: .{n.func.attr}()"
    return found


@pytest.mark.slow  # over ~2.5 s on a quiet machine: CI runs it with the slow tests
def test_no_module_keeps_a_cache_of_per_file_facts():
    mutated = _mutated_module_state()
    caches = {name: how for name, how in mutated.items() if name not in ALLOWED_MODULE_STATE}
    assert caches == {}, "module-level state filled per call: keep per-file facts in SourceFacts (rewrite/facts.py)"
    stale = sorted(set(ALLOWED_MODULE_STATE) - set(mutated))
    assert stale == [], "no longer module state that functions fill: remove from ALLOWED_MODULE_STATE"


# ---------------------------------------------------------------- one nn.Module subclass scan
SEQUENTIAL_SUBCLASS = (
    "import torch\nimport torch.nn as nn\n\n\n"
    "class Stack(nn.Sequential):\n    pass\n\n\n"
    "net = Stack(nn.Linear(4, 4))\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
    "for x in torch.randn(3, 2, 4):\n"
    "    net.zero_grad(set_to_none=False)\n    net(x).sum().backward()\n    opt.step()\n"
)


def test_zero_grad_rules_know_a_subclass_of_any_torch_nn_class_is_a_module():
    """The zero_grad family used to accept only direct ``nn.Module`` subclasses, unlike the step-loop,
    AMP and DDP analyses: a subclass of ``nn.Sequential`` was an unknown receiver, and the fix said
    it was only assuming ``net`` is a module. Now all of them share one scan."""
    diags = engine.check_source(SEQUENTIAL_SUBCLASS, Settings(select=("TOP831",)), "t.py").diagnostics
    assert [(d.code, d.line) for d in diags] == [("TOP831", 12)]
    fix = diags[0].fix
    assert fix is not None and fix.title == "Set gradients to None: `net.zero_grad()`"
    assert "assuming" not in fix.note
