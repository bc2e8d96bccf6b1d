"""LibCST fast paths the entry points install (rewrite/speedups.py) must be invisible: the read-only
walk (rewrite/fastvisit.py) makes exactly the calls LibCST's own traversal makes, positions
(rewrite/positions.py) equal LibCST's for every node, and the engine reports the same diagnostics and
makes the same fixes with them as without them.
Every test here installs them explicitly and puts LibCST back afterwards."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import (
    ExpressionContextProvider,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from torchopt.rewrite import fastvisit, positions, speedups

ROOT = Path(__file__).resolve().parents[1]

SYNTAX = """\
from __future__ import annotations
import torch, torch.nn as nn
from torch import *
from . import sibling
from ..pkg.mod import (a as b, c)
x: int = 1
y = [i * 2 for i in range(3) if i] + list({k: v for k, v in {}.items()}) + [*(j for j in ())]
z = {1, 2} | {3} if x else {4}
s = f"{x!r:>{y}} {z=} {{}}" + str(rb'raw' b"implicit")
t = lambda a, /, b=1, *c, d, e=2, **f: (a, b, c, d, e, f)
del x
global_name = 0


@decorator(arg)
@other
class K(Base, metaclass=Meta):
    attr: "torch.Tensor"
    __slots__ = ()

    async def m(self, p: int = 3, *, q) -> None:
        global global_name
        async with ctx() as (u, w), other():
            async for i in aiter():
                await something(i)
        try:
            pass
        except (ValueError, TypeError) as err:
            raise RuntimeError("x") from err
        else:
            return
        finally:
            del p
        try:
            pass
        except* OSError:
            pass
        while (n := next(it, None)) is not None:
            if n > 1 and not n < 0 or n in (1, 2) and n is not None:
                break
            elif n:
                continue
            else:
                ...
        match command.split():
            case [action, *rest] if rest:
                pass
            case {"k": 1, **kw}:
                pass
            case Point(x=0, y=_) | [1, 2]:
                pass
            case str() as s2:
                pass
        x = yield from gen()
        y = yield
        a, *b = c = d[1:2, ::3] = e.f[g] = 1
        x += 1; y @= z
        assert x, "message"
        print(*args, **kwargs, sep="")
        nonlocal_free = [lambda: q for _ in ()]
        return ~x ** -y // +z


def outer():
    v = 1

    def inner():
        nonlocal v
        v = torch.zeros(3).cuda()
    return inner


with open("f") as fh, open("g"):
    pass
for i, (j, k) in enumerate(pairs):
    print(i)
else:
    print("done")
type Alias = list[int]
def generic[T](x: T) -> T:
    return x
"""


def _sources() -> list[tuple[str, str]]:
    out = [("syntax", SYNTAX)]
    for path in sorted((ROOT / "fixtures").rglob("*.py"))[:60]:
        out.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    return out


SOURCES = _sources()


@pytest.fixture(autouse=True)
def fast_paths():
    speedups.uninstall()
    assert speedups.install() == speedups.DEFAULT
    yield
    speedups.uninstall()


@contextmanager
def libcst_own_visit():
    fast = cst.CSTNode.visit
    cst.CSTNode.visit = fastvisit._ORIGINAL_VISIT  # type: ignore[method-assign]
    try:
        yield
    finally:
        cst.CSTNode.visit = fast  # type: ignore[method-assign]


@contextmanager
def libcst_own_code():
    """Every fast path out (LibCST's own code), then back in."""
    names = speedups.installed()
    speedups.uninstall()
    try:
        yield
    finally:
        speedups.install(names)


class Everything(cst.CSTVisitor):
    """Overrides all four callbacks: the walk must call attribute callbacks for every node."""

    def __init__(self, skip: type | None = None) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.skip = skip

    def on_visit(self, node):
        self.log.append(("visit", id(node), type(node).__name__))
        return not (self.skip and isinstance(node, self.skip))

    def on_leave(self, original_node):
        self.log.append(("leave", id(original_node)))

    def on_visit_attribute(self, node, attribute):
        self.log.append(("enter", id(node), attribute))

    def on_leave_attribute(self, original_node, attribute):
        self.log.append(("exit", id(original_node), attribute))


class AttributeMethods(cst.CSTVisitor):
    """Uses LibCST's default dispatch to ``visit_<Class>_<field>`` methods, which the walk may only
    skip for classes it has none for."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def visit_Call_func(self, node):
        self.log.append(("call.func", id(node)))

    def leave_Call_args(self, node):
        self.log.append(("call.args/", id(node)))

    def visit_FunctionDef_body(self, node):
        self.log.append(("def.body", id(node)))

    def visit_Name(self, node):
        self.log.append(("name", node.value))

    def leave_Attribute(self, node):
        self.log.append(("attr/", id(node)))


class BatchA(cst.BatchableCSTVisitor):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def visit_Call(self, node):
        self.log.append(("A.call", id(node)))

    def visit_Call_args(self, node):
        self.log.append(("A.call.args", id(node)))

    def leave_ClassDef_body(self, node):
        self.log.append(("A.class.body/", id(node)))


class BatchB(cst.BatchableCSTVisitor):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def visit_Name(self, node):
        self.log.append(("B.name", id(node)))

    def leave_Call(self, node):
        self.log.append(("B.call/", id(node)))

    def leave_Subscript_slice(self, node):
        self.log.append(("B.sub.slice/", id(node)))


def _events(module: cst.Module, make) -> list:
    visitor = make()
    module.visit(visitor)
    return visitor.log


@pytest.mark.parametrize("name,text", SOURCES, ids=[n for n, _ in SOURCES])
def test_same_callbacks_in_the_same_order(name: str, text: str) -> None:
    module = cst.parse_module(text)
    for make in (Everything, lambda: Everything(skip=cst.FunctionDef), AttributeMethods):
        fast = _events(module, make)
        with libcst_own_visit():
            slow = _events(module, make)
        assert fast == slow
        assert fast  # the walk saw something


@pytest.mark.parametrize("name,text", SOURCES[:12], ids=[n for n, _ in SOURCES[:12]])
def test_batched_visitors_and_hooks(name: str, text: str) -> None:
    module = cst.parse_module(text)

    def run() -> list:
        log: list = []
        cst.visit_batched(
            module,
            [BatchA(log), BatchB(log)],
            before_visit=lambda n: log.append(("before", id(n))),
            after_leave=lambda n: log.append(("after", id(n))),
        )
        return log

    fast = run()
    with libcst_own_visit():
        slow = run()
    assert fast == slow
    assert any(e[0] == "A.call.args" for e in fast) or "(" not in text


@pytest.mark.parametrize("name,text", SOURCES[:12], ids=[n for n, _ in SOURCES[:12]])
def test_metadata_providers_agree(name: str, text: str) -> None:
    module = cst.parse_module(text)

    in_tree = {id(module)}
    stack = [module]
    while stack:
        for child in stack.pop().children:
            in_tree.add(id(child))
            stack.append(child)

    def key(node: object) -> object:
        # Scope analysis parses string annotations into fresh nodes each time: compare those by text.
        if node is None or id(node) in in_tree:
            return id(node)
        return (type(node).__name__, cst.Module([]).code_for_node(node) if isinstance(node, cst.CSTNode) else node)

    def resolve() -> tuple:
        w = MetadataWrapper(module, unsafe_skip_copy=True)
        scopes = w.resolve(ScopeProvider)
        ctx = w.resolve(ExpressionContextProvider)
        parents = w.resolve(ParentNodeProvider)
        pos = w.resolve(PositionProvider)
        per_scope = {}
        for node, scope in scopes.items():
            if scope is not None and id(scope) not in per_scope:
                per_scope[id(scope)] = (
                    type(scope).__name__,
                    sorted(map(str, ((a.name, key(getattr(a, "node", None))) for a in scope.assignments))),
                    sorted(
                        map(
                            str,
                            (
                                (key(a.node), sorted(map(str, (key(getattr(x, "node", None)) for x in a.referents))))
                                for a in scope.accesses
                            ),
                        )
                    ),
                )
        return (
            sorted(per_scope.values()),
            {key(k): str(v) for k, v in ctx.items()},
            {key(k): key(v) for k, v in parents.items()},
            {key(k): (v.start, v.end) for k, v in pos.items()},
        )

    fast = resolve()
    with libcst_own_code():
        slow = resolve()
    assert fast == slow


def test_transformers_still_rebuild_the_tree() -> None:
    module = cst.parse_module("x = torch.zeros(3)\n")

    class Rename(cst.CSTTransformer):
        def leave_Name(self, original_node, updated_node):
            return updated_node.with_changes(value=updated_node.value.upper())

    assert module.visit(Rename()).code == "X = TORCH.ZEROS(3)\n"
    assert module.code == "x = torch.zeros(3)\n"


@pytest.mark.parametrize("name,text", SOURCES, ids=[n for n, _ in SOURCES])
def test_positions_equal_libcsts_for_every_node(name: str, text: str) -> None:
    module = cst.parse_module(text)
    fast = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    assert isinstance(fast, positions.Ranges)
    slow = positions._ORIGINAL_GEN(PositionProvider(), MetadataWrapper(module, unsafe_skip_copy=True))
    assert len(fast) == len(slow) > 0
    for node, rng in slow.items():
        assert node in fast
        assert fast[node] == rng, (type(node).__name__, fast[node], rng)
        assert fast.get(node) == rng
    other = cst.parse_module(text)
    assert other.body and other.body[0] not in fast
    assert fast.get(other.body[0]) is None
    with pytest.raises(KeyError):
        fast[other.body[0]]


def test_position_subclasses_keep_their_own_computation() -> None:
    from libcst.metadata import WhitespaceInclusivePositionProvider

    module = cst.parse_module("x = 1  \n")
    rng = MetadataWrapper(module, unsafe_skip_copy=True).resolve(WhitespaceInclusivePositionProvider)
    assert not isinstance(rng, positions.Ranges)


def test_module_only_batched_visitors_see_the_module() -> None:
    module = cst.parse_module("import torch\nx = torch.zeros(3)\n")

    class OnlyModule(cst.BatchableCSTVisitor):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def visit_Module(self, node):
            self.log.append(("visit", id(node)))

        def leave_Module(self, node):
            self.log.append(("leave", id(node)))

    def run() -> list:
        log: list = []
        cst.visit_batched(module, [OnlyModule(log), OnlyModule(log)])
        return log

    fast = run()
    with libcst_own_visit():
        slow = run()
    assert fast == slow == [("visit", id(module))] * 2 + [("leave", id(module))] * 2


ENGINE_SOURCES = [(n, t) for n, t in SOURCES if n.endswith("before.py")][:8]


@pytest.mark.parametrize("name,text", ENGINE_SOURCES, ids=[n for n, _ in ENGINE_SOURCES])
def test_the_engine_gives_the_same_results_with_and_without_them(name: str, text: str) -> None:
    from torchopt.rewrite.config import Settings
    from torchopt.rewrite.engine import check_source, fix_source

    settings = Settings()

    def results() -> tuple:
        fixed = fix_source(text, settings, name, unsafe=True)
        return (
            [d.to_json() for d in check_source(text, settings, name).diagnostics],
            fixed.text,
            [d.to_json() for d in fixed.applied],
            [d.to_json() for d in fixed.remaining],
        )

    fast = results()
    speedups.uninstall()
    slow = results()
    assert fast == slow


def test_isinstance_on_node_classes_answers_what_the_hierarchy_says() -> None:
    """With the fast path, isinstance/issubclass on node classes skip ABCMeta's Python-level check:
    every answer must still be plain inheritance, abstract classes stay abstract, and uninstalling it
    gives every class ABCMeta back."""
    import abc
    import inspect

    speedups.install(["isinstance"])
    classes = fastvisit.node_classes()
    assert type(cst.Call) is fastvisit.PlainChecks and isinstance(cst.Call, abc.ABCMeta)
    samples: dict[type, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = [cst.parse_module(SYNTAX)]
    while stack:
        node = stack.pop()
        samples.setdefault(type(node), node)
        stack.extend(node.children)
    assert len(samples) > 60
    for cls in classes:
        for kind, node in samples.items():
            assert isinstance(node, cls) == (cls in kind.__mro__), (kind.__name__, cls.__name__)
            assert issubclass(kind, cls) == (cls in kind.__mro__)
        assert not isinstance("text", cls) and not isinstance(None, cls)
    assert isinstance(samples[cst.Import], (cst.Import, cst.ImportFrom))
    for cls in (cst.CSTNode, cst.BaseExpression, cst.BaseStatement, cst.BaseSmallStatement):
        assert inspect.isabstract(cls)
        with pytest.raises(TypeError):
            cls()  # type: ignore[abstract]
    with libcst_own_code():
        assert all(type(cls) is abc.ABCMeta for cls in classes)
    assert type(cst.Call) is fastvisit.PlainChecks


def _top_level_nodes(module: cst.Module) -> list[list[cst.CSTNode]]:
    out = []
    for stmt in module.body:
        nodes, stack = [], [stmt]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children)
        out.append(nodes)
    return out


@pytest.mark.parametrize("name,text", SOURCES, ids=[n for n, _ in SOURCES])
def test_positions_of_a_few_nodes_equal_the_whole_files(name: str, text: str) -> None:
    """The engine generates only the statements that hold reported nodes, each from its own line:
    for every node of every statement (asked statement by statement, and all at once) the range is
    the one the whole file's positions give."""
    import ast

    module = cst.parse_module(text)
    try:
        tree: object = ast.parse(text)
    except SyntaxError as exc:  # syntax newer than this Python: the whole file's positions answer
        tree = exc
    with libcst_own_code():
        full = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    per_statement = _top_level_nodes(module)
    for nodes in per_statement + [[n for ns in per_statement for n in ns]]:
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        got = positions.positions_for(wrapper, text, tree)
        for node in nodes:
            assert got[node] == full[node], (name, type(node).__name__)
        assert (PositionProvider in wrapper._metadata) == (not isinstance(tree, ast.Module))


@pytest.mark.parametrize(
    "text",
    [
        "import torch\nx = torch.zeros(3).cuda()",  # no newline at the end: the last statement differs
        "# header\n\n@dec\n# between\n@dec2\ndef f():\n    pass\nx = 1; y = torch.ones(2)\n",
        "if True: x = 1\nclass A(  # c\n  B):\n    z = 2\n",
    ],
)
def test_positions_of_odd_layouts_match_or_fall_back(text: str) -> None:
    import ast

    module = cst.parse_module(text)
    with libcst_own_code():
        full = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    nodes = [n for ns in _top_level_nodes(module) for n in ns] + [module]
    got = positions.positions_for(MetadataWrapper(module, unsafe_skip_copy=True), text, ast.parse(text))
    for node in nodes:
        assert got[node] == full[node]


def _visitor_classes() -> list[type]:
    import importlib
    import pkgutil

    import torchopt

    for info in pkgutil.walk_packages(torchopt.__path__, prefix="torchopt."):
        if not info.name.endswith("__main__") and ".lsp" not in info.name:
            importlib.import_module(info.name)
    found, stack = [], [cst.BatchableCSTVisitor]
    while stack:
        for sub in stack.pop().__subclasses__():
            found.append(sub)
            stack.append(sub)
    return sorted(set(found), key=lambda c: (c.__module__, c.__qualname__))


class _Odd(cst.BatchableCSTVisitor):
    """Visitor methods LibCST finds by their own name, not the attribute's, and through descriptors."""

    def helper(self, node: cst.Name) -> None:
        pass

    visit_Name = helper  # a bound method named `helper`: not a visitor method for LibCST
    leave_Call_func = cst.BatchableCSTVisitor.leave_Call_func  # a no-op stub under its own name
    alias = cst.CSTVisitor.visit_Name  # a stub: no-op

    def visit_Attribute(self, node: cst.Attribute) -> None:
        pass

    other = visit_Attribute  # listed twice by LibCST: `other` and `visit_Attribute`

    @classmethod
    def visit_Call(cls, node: cst.Call) -> None:
        pass

    @staticmethod
    def visit_Subscript(node: cst.Subscript) -> None:
        pass

    @property
    def visit_Arg(self):
        return self.visit_Attribute


def test_batched_visitors_find_the_same_visitor_methods() -> None:
    """Every batched visitor of LibCST and torchopt (metadata providers among them), and one of odd
    definitions, with and without attributes of its own, gets the same methods as from LibCST's
    ``inspect.getmembers``."""
    classes = [*_visitor_classes(), _Odd]
    checked = 0
    for cls in classes:
        try:
            visitor = cls()
        except TypeError:  # needs arguments (a rule, its context): the class's methods are what counts
            visitor = cls.__new__(cls)
        checked += 1
        assert fastvisit.fast_get_visitors(visitor) == fastvisit._ORIGINAL_GET_VISITORS(visitor), cls
    assert checked > 50 and ScopeProvider in classes and ParentNodeProvider in classes
    odd = _Odd()
    assert set(fastvisit.fast_get_visitors(odd)) == {"visit_Attribute", "other", "visit_Call", "visit_Arg"}
    odd.visit_Name = odd.visit_Attribute  # an instance attribute: LibCST's own answer
    odd.extra = odd.visit_Attribute
    assert fastvisit.fast_get_visitors(odd) == fastvisit._ORIGINAL_GET_VISITORS(odd)
    assert "extra" in fastvisit.fast_get_visitors(odd)
