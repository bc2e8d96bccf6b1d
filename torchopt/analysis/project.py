"""The project index: what the other files of the analysed file's project say about the names it
uses. A model class defined in ``models/net.py``, a training step in ``engine.py``, a helper that
builds the loader's arguments in ``utils.py``: a rule asks :func:`index_of` and gets the definition,
or an explicit :class:`Unknown` that says which fact could not be established and why ("`Net` is
defined in models/net.py, which is not part of this run").

Names are resolved the way Python would import them when the analysed file runs as a script or
inside its package: ``from models.net import Net``, ``from .engine import train_one_epoch``,
``import utils``, ``from models import resnet18`` through the package ``__init__``'s re-export.
An absolute import is looked for next to the importing file, then in each folder above it up to the
project folder; a name that resolves to no file there is not the project's (a library's): ``None``.

Each module's summary (``project_summary.py``) is computed once per run with CPython's ``ast``, only
for files a rule's question reaches, and kept in the result cache by the hash of the file's bytes; the
files read are recorded with the asking file's cache entry, which holds only while they are unchanged
(``torchopt/rewrite/projectscope.py``). In the language server the scope outlives a run
(``LiveScope``): open documents are read from the editor's text, and an edit makes only the edited
module's summary again. Nothing is built unless a rule asks.
"""

from __future__ import annotations

import builtins
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Union

from torchopt.analysis.project_summary import ModuleSummary, Unit, summarize
from torchopt.rewrite.projectscope import ProjectScope
from torchopt.rewrite.pyast import parse
from torchopt.rewrite.rule import Rule

# Top-level names that are never the project's own modules: the standard library and torch's stack.
_LIBRARIES = frozenset(sys.stdlib_module_names) | {"torch", "torchvision", "torchaudio", "numpy", "typing_extensions"}
MAX_DEPTH = 6  # re-exports, bases and calls followed before giving up (unknown)


@dataclass(frozen=True)
class Unknown:
    """A fact that could not be established; ``reason`` says which and why, for messages."""

    reason: str
    file: str = ""  # the file that could not be read, as messages name it, when that is the cause


@dataclass(frozen=True)
class Definition:
    """A class or function of the project (``kind`` "class" / "function"), or a module ("module")."""

    kind: str
    name: str
    path: str  # real path of the file that defines it
    module: ModuleSummary
    unit: Unit | None = None  # None for a module


@dataclass
class Layers:
    """What building a class (or calling a function) creates: layer kind -> count, Linear widths, and
    where the layers were found (files, as shown in messages)."""

    counts: dict[str, int] = field(default_factory=dict)
    widths: list[int] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    unknown: list[Unknown] = field(default_factory=list)  # parts that could not be followed

    def has(self, kind: str) -> bool:
        return self.counts.get(kind, 0) > 0


Resolved = Union[Definition, Unknown, None]


MAX_FILES = 2000  # a project read file by file beyond this is not listed (its files are then unknown)
_SKIPPED = frozenset(("node_modules", "site-packages", "__pycache__", "build", "dist"))


def project_files(unit: str) -> list[str] | Unknown:
    """The Python files of the project folder ``unit`` (real paths, sorted; hidden folders, virtual
    environments and build output left out), or Unknown when there are more than ``MAX_FILES``. A file
    that appears later is not seen until the next run; the files read through the scope are recorded."""
    out: list[str] = []
    for folder, dirs, files in os.walk(unit):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED and "venv" not in d)
        out += [os.path.realpath(os.path.join(folder, f)) for f in sorted(files) if f.endswith(".py")]
        if len(out) > MAX_FILES:
            return Unknown(f"the project holds more than {MAX_FILES} Python files, which are not all read")
    return out


class ProjectIndex:
    """The project index as seen from one analysed file (``path``, with its current text's summary)."""

    def __init__(self, scope: ProjectScope, path: str, own: ModuleSummary) -> None:
        self.scope = scope
        real = os.path.realpath(path)
        self.path = real if os.path.isfile(real) else None  # stdin without a file name: no project
        self.unit = scope.unit(real) if self.path is not None else None
        self.own = own

    # ------------------------------------------------------------------ files
    def shown(self, path: str) -> str:
        """``path`` relative to the analysed file's folder, as messages name it."""
        base = os.path.dirname(self.path) if self.path else os.getcwd()
        rel = os.path.relpath(path, base)
        return path if rel.startswith(os.pardir + os.sep + os.pardir) else rel

    def summary(self, path: str) -> ModuleSummary | None:
        if self.path is not None and os.path.realpath(path) == self.path:
            return self.own
        return self.scope.file_fact(
            path, "module summary", lambda text: summarize(parse(text)), ModuleSummary.to_json, ModuleSummary.from_json
        )

    def module_file(self, module: str, level: int, importer: str) -> str | Unknown | None:
        """The file of ``module`` imported from the file ``importer``: a path, Unknown (it exists but
        may not be read in this run), or None (not a module of the project)."""
        if self.path is None or self.unit is None:
            return None
        parts = [p for p in module.split(".") if p]
        if not level and parts and parts[0] in _LIBRARIES:
            return None
        if level:
            base = os.path.dirname(importer)
            for _ in range(level - 1):
                base = os.path.dirname(base)
            bases = [base]
        else:
            bases = []
            cur = os.path.dirname(importer)
            while True:
                bases.append(cur)
                if cur == self.unit or not cur.startswith(self.unit) or os.path.dirname(cur) == cur:
                    break
                cur = os.path.dirname(cur)
        for base in bases:
            stem = os.path.join(base, *parts)
            for cand in (
                (stem + ".py", os.path.join(stem, "__init__.py")) if parts else (os.path.join(base, "__init__.py"),)
            ):
                if not self.scope.exists(cand):
                    continue
                if not self.scope.may_read(cand, self.unit):
                    return Unknown(f"{self.shown(cand)} is not part of this run", self.shown(cand))
                return os.path.realpath(cand)
        return None

    # ------------------------------------------------------------------ names
    def resolve(
        self, written: str, summary: ModuleSummary | None = None, path: str | None = None, depth: int = 0
    ) -> Resolved:
        """What the name ``written`` (``Net``, ``models.resnet18``) means in the module ``path`` (the
        analysed file by default): a Definition of the project, Unknown, or None (not the project's)."""
        summary = summary or self.own
        path = path or self.path
        if path is None or depth > MAX_DEPTH:
            return Unknown(f"`{written}` could not be followed") if path else None
        head, _, rest = written.partition(".")
        if head in summary.classes or head in summary.functions:
            if rest:
                return None
            unit = summary.classes.get(head) or summary.functions[head]
            return Definition("class" if head in summary.classes else "function", head, path, summary, unit)
        imported = summary.imports.get(head)
        if imported is None:
            return None
        module, name, level = imported
        target: Resolved
        if name:
            target = self._attribute(module, level, name, path, depth)
        else:
            target = self._module(module, level, path)
        if isinstance(target, Unknown) and target.file and depth == 0:
            return Unknown(f"`{written}` comes from {target.file}, which is not part of this run", target.file)
        if not rest or not isinstance(target, Definition):
            return target
        if target.kind != "module":
            return None
        return self.resolve(rest, target.module, target.path, depth + 1)

    def origin(
        self, written: str, summary: ModuleSummary | None = None, path: str | None = None, depth: int = 0
    ) -> str | None:
        """The library name (``tqdm.tqdm``) that ``written``, used in the module ``path`` (the analysed
        file by default), comes from through the imports of the project's own modules (``from
        utils.general import TQDM``, where ``utils/general.py`` imports it from a library); None when
        it is the project's own, a local value, or cannot be followed."""
        summary = summary or self.own
        path = path or self.path
        head = written.partition(".")[0]
        if path is None or depth > MAX_DEPTH or head not in summary.imports:
            return None
        full = summary.qualify(written)
        module, name, level = summary.imports[head]
        if full is None or not name:
            return None
        mod = self._module(module, level, path)
        if mod is None:
            return full[0] if not level else None  # a library's name
        if isinstance(mod, Definition) and name in mod.module.imports and written == head:
            return self.origin(name, mod.module, mod.path, depth + 1)
        return None

    def _module(self, module: str, level: int, importer: str) -> Resolved:
        f = self.module_file(module, level, importer)
        if not isinstance(f, str):
            return f
        s = self.summary(f)
        if s is None or not s.parsed:
            return Unknown(f"{self.shown(f)} could not be read or parsed")
        return Definition("module", module, f, s)

    def _attribute(self, module: str, level: int, name: str, importer: str, depth: int) -> Resolved:
        """``from module import name``: a definition there, a re-export it imports, or a submodule."""
        mod = self._module(module, level, importer)
        if isinstance(mod, Definition) and (
            name in mod.module.classes or name in mod.module.functions or name in mod.module.imports
        ):
            return self.resolve(name, mod.module, mod.path, depth + 1)
        sub = self._module(f"{module}.{name}" if module else name, level, importer)
        if sub is not None:
            return sub
        if isinstance(mod, Definition) and name in mod.module.globals:
            return Unknown(f"`{name}` is a value assigned in {self.shown(mod.path)}, not a class or function")
        return mod if isinstance(mod, Unknown) else None

    # ------------------------------------------------------------------ what building it creates
    def layers(self, d: Definition) -> Layers:
        """The layers a class builds (through its project bases and the project classes its body
        builds), or that a function builds when called (through what it calls)."""
        out = Layers()
        self._collect(d, out, set(), 0)
        return out

    def _collect(self, d: Definition, out: Layers, seen: set, depth: int) -> None:
        key = (d.path, d.name)
        if key in seen or d.unit is None:
            return
        seen.add(key)
        if depth > MAX_DEPTH:
            out.unknown.append(Unknown(f"`{d.name}` is built through more than {MAX_DEPTH} levels"))
            return
        if d.unit.layers and self.shown(d.path) not in out.where:
            out.where.append(self.shown(d.path))
        for kind, n in d.unit.layers.items():
            out.counts[kind] = out.counts.get(kind, 0) + n
        out.widths.extend(d.unit.widths)
        for written in [*d.unit.bases, *d.unit.calls]:
            got = self.resolve(written, d.module, d.path)
            if isinstance(got, Unknown):
                out.unknown.append(Unknown(f"`{written}` (used by `{d.name}`): {got.reason}"))
            elif isinstance(got, Definition) and got.kind != "module":
                self._collect(got, out, seen, depth + 1)

    def is_module_class(self, d: Definition, depth: int = 0) -> bool | Unknown:
        """Whether the class ``d`` subclasses ``torch.nn.Module``, directly or through project bases."""
        if d.unit is None or d.kind != "class" or depth > MAX_DEPTH:
            return Unknown(f"`{d.name}` could not be followed") if depth > MAX_DEPTH else False
        for base in d.unit.bases:
            q = d.module.qualify(base)
            if q is not None and q[1] == 0 and q[0] in ("torch.nn.Module", "torch.nn.modules.module.Module"):
                return True
            got = self.resolve(base, d.module, d.path, depth + 1)
            if isinstance(got, Unknown):
                return got
            if isinstance(got, Definition) and got.kind == "class":
                sub = self.is_module_class(got, depth + 1)
                if sub is not False:
                    return sub
        return False

    # ------------------------------------------------------------------ what calling it runs
    def runs(self, d: Definition, fact: str) -> bool | Unknown:
        """Whether the project function ``d``, or a project function it calls (followed through the
        project, ``MAX_DEPTH`` deep), has the summary fact ``fact`` ("steps": calls ``backward()``;
        "amp": names torch's autocast or GradScaler; a project class counts with what its body has).
        Unknown when a call could not be followed, a call of a parameter or local value
        (``trainer.step(batch)``, whose code is not known) included, and nothing followed had it."""
        unknown: Unknown | None = None
        todo, seen = [(d, 0)], set()
        while todo:
            cur, depth = todo.pop()
            if cur.unit is None or (cur.path, cur.name) in seen:
                continue
            seen.add((cur.path, cur.name))
            if getattr(cur.unit, fact):
                return True
            if cur.kind == "class":
                continue
            for written in cur.unit.calls:
                got = self.resolve(written, cur.module, cur.path)
                if isinstance(got, Unknown) or (isinstance(got, Definition) and depth >= MAX_DEPTH):
                    unknown = unknown or Unknown(f"`{written}` (called by `{cur.name}`) could not be followed")
                elif isinstance(got, Definition) and got.kind in ("function", "class"):
                    todo.append((got, depth + 1))
                elif got is None and not _module_level(cur.module, written):
                    unknown = unknown or Unknown(f"what `{written}` (called by `{cur.name}`) runs is not known")
        return unknown or False

    # ------------------------------------------------------------------ what calling it switches on
    def asks_determinism(self, d: Definition, argument: Callable[[str, int], str | None]) -> bool | Unknown:
        """Whether a call of the project function ``d`` turns a determinism switch on
        (``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic = True``): True when one
        runs unconditionally or under a parameter the call sets to ``True``; an Unknown when a value
        known only at run time decides. ``argument(name, position)`` is what the call passes for a
        parameter, as written (``"True"``, ``"args.det"``), ``""`` for nothing, None when that cannot
        be told (``*args``)."""
        unit = d.unit
        if unit is None or d.kind != "function":
            return False
        unknown: Unknown | None = None
        for decider in unit.determinism:
            if decider == "":
                return True
            name, _, default = decider.partition(":")
            passed = argument(name, unit.params.index(name)) if name in unit.params else None
            value = default if passed == "" else passed
            if value == "True":
                return True
            if value in ("False", "None"):
                continue
            if decider == "?":
                why = "under a condition known only at run time"
            elif value:
                why = f"when `{name}` is true, and this call passes `{value}`, known only at run time"
            else:
                why = f"when `{name}` is true, and what this call passes for it cannot be told"
            unknown = unknown or Unknown(f"`{d.name}` ({self.shown(d.path)}) sets a determinism switch {why}")
        return unknown or False


def _module_level(module: ModuleSummary, written: str) -> bool:
    """Whether the head of the name ``written`` is a builtin or a name of the module (an import, a
    global, a definition): not a parameter or local value of a function."""
    head = written.partition(".")[0]
    return (
        hasattr(builtins, head)
        or head in module.imports
        or head in module.globals
        or head in module.functions
        or head in module.classes
    )


def index_of(rule: Rule) -> ProjectIndex:
    """The project index for the file ``rule`` analyses: ask it what a name used in this file is
    (``resolve("Net")``, ``resolve("engine.train_one_epoch")``), what a project class or function
    builds (``layers``), whether a class is an ``nn.Module`` (``is_module_class``), which module file
    an import names (``module_file``). Every answer is a fact, ``None`` (not the project's: a library
    name, a local value) or an :class:`Unknown` whose ``reason`` names the fact that could not be
    established, to put in the message; a rule that needs an unknown fact does not fix.

    Made once per analysed text; what it learns about other modules is shared by the whole run
    through the rule context's project scope (``rule.ctx.project``), and the files it reads are
    recorded so that this file's cached result is dropped when one of them changes."""
    ctx = rule.ctx
    return ctx.facts.derived(
        ("project index",), lambda: ProjectIndex(ctx.project, ctx.path, summarize(ctx.facts.python_ast))
    )
