"""The rule protocol: what a rule declares, how it reports a finding, and its tested examples.

The engine knows this protocol and nothing about any particular rule.
"""

from __future__ import annotations

import enum
import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import libcst as cst
from libcst._metadata_dependent import _UNDEFINED_DEFAULT
from libcst.metadata import BaseMetadataProvider, MetadataWrapper
from libcst.metadata import PositionProvider, ScopeProvider

from torchopt.rewrite.projectscope import ProjectScope, current_scope
from torchopt.rewrite.facts import SourceFacts, analysing, current_facts
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.positions import file_positions


class Safety(str, enum.Enum):
    """How a fix may be applied. SAFE: bitwise-identical results; UNSAFE: only with --unsafe-fixes;
    DISPLAY: a diagnostic with advice and no automatic fix."""

    SAFE = "safe"
    UNSAFE = "unsafe"
    DISPLAY = "display-only"


class Tag(str, enum.Enum):
    """What an unsafe fix changes (docs/design.md, "Fix safety")."""

    TOLERANCE = "tolerance"  # same maths, other rounding or kernels
    NUMERICS = "numerics"  # precision deliberately reduced
    RNG = "rng"  # random numbers come from another generator or stream offset
    SEMANTICS = "semantics"  # behaviour a user can see (leaf-ness, launch, shapes)


TAG_MEANING = {
    Tag.TOLERANCE: "results may differ by rounding (other kernel or reassociation)",
    Tag.NUMERICS: "precision is reduced on purpose",
    Tag.RNG: "random numbers are drawn from another generator or stream position",
    Tag.SEMANTICS: "behaviour a user can observe changes",
}


@dataclass(frozen=True)
class Valid:
    """Source the rule must not flag."""

    src: str
    note: str = ""
    runnable: bool = False


@dataclass(frozen=True)
class Invalid:
    """Source the rule must flag. ``after`` is the exact rewrite (None: no fix may change the text).
    ``unsafe`` names the tag(s) of an unsafe fix: it is applied only with --unsafe-fixes.
    ``runnable`` examples are executed before and after on the CPU and compared bitwise."""

    src: str
    after: str | None = None
    unsafe: str | tuple[str, ...] | None = None
    runnable: bool = False
    note: str = ""

    @property
    def unsafe_tags(self) -> tuple[str, ...]:
        if self.unsafe is None:
            return ()
        return (self.unsafe,) if isinstance(self.unsafe, str) else tuple(self.unsafe)


@dataclass(frozen=True)
class Option:
    """A typed per-rule option, set under ``[tool.torchopt.rules.CODE]``."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ImportSpec:
    """An import a fix needs, scheduled through LibCST's AddImportsVisitor."""

    module: str
    obj: str | None = None
    asname: str | None = None


# What a fix puts in place of its node: a node, several statements, or nothing (a removed statement),
# exactly what a LibCST transformer's leave method may return.
Replacement = cst.CSTNode | cst.FlattenSentinel | cst.RemovalSentinel


@dataclass(frozen=True, eq=False)
class Later:
    """A replacement made only when the fix is applied: diagnostics need to know that a fix exists,
    not the rewritten code, and a fix that rebuilds a whole function or module costs more than finding
    it. ``make`` must depend only on what the rule decided when it reported (the nodes of this parse)."""

    make: Callable[[], Replacement]


@dataclass
class Finding:
    """One report of one rule on one node, kept in memory during a pass (holds CST nodes)."""

    rule: type["Rule"]
    node: cst.CSTNode
    message: str
    fix_title: str | None = None
    replacement: Replacement | Later | None = None
    target: cst.CSTNode | None = None  # node the replacement stands in for (default: node)
    safety: Safety = Safety.DISPLAY
    tags: tuple[Tag, ...] = ()
    note: str = ""
    imports: tuple[ImportSpec, ...] = ()

    def fixed_node(self) -> Replacement | None:
        """The replacement, made now if the rule left it for later (then kept)."""
        if isinstance(self.replacement, Later):
            self.replacement = self.replacement.make()
        return self.replacement


@dataclass
class RuleContext:
    """What a rule instance sees of its surroundings for one parse."""

    module: cst.Module
    options: Mapping[str, Any]
    device_names: tuple[str, ...]
    path: str = "<string>"
    findings: list[Finding] = field(default_factory=list)
    # The source the module was parsed from: cheaper than `module.code`, which regenerates it.
    text: str = ""
    # What is known about this text (CPython's parse, shared walks): one object per text, made by the
    # engine and shared by every rule of the pass; a context made on its own gets its own.
    facts: SourceFacts = None  # type: ignore[assignment]  # never None once made: __post_init__ fills it in

    def __post_init__(self) -> None:
        if not self.text:
            self.text = self.module.code
        if self.facts is None:
            self.facts = SourceFacts(self.text, self.module)

    @property
    def project(self) -> ProjectScope:
        """The other files of this file's project that rules may read, and what was learnt from them:
        the run's scope, or (outside a run: stdin, the language server) one for this text alone. Rules
        ask questions about other modules through ``torchopt.analysis.project.index_of(rule)``."""
        return current_scope() or self.facts.derived(("project scope",), ProjectScope)


class Rule(cst.BatchableCSTVisitor):
    """Base class: a LibCST batchable visitor that calls :meth:`report` on what it finds."""

    code: ClassVar[str]
    name: ClassVar[str]
    family: ClassVar[str]
    message: ClassVar[str]
    fix_title: ClassVar[str | None] = None
    safety: ClassVar[Safety] = Safety.SAFE
    tags: ClassVar[tuple[Tag, ...]] = ()
    examples: ClassVar[Sequence[Valid | Invalid]] = ()
    # The file is parsed for this rule only if one of these substrings occurs in it.
    prefilter: ClassVar[tuple[str, ...]] = ()
    # ... and only if every one of these occurs too: e.g. ("torch",) for a rule that matches only
    # torch-qualified names (a file that never says "torch" cannot import it). See could_match.
    requires: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    # The oldest PyTorch (major, minor) that has the API the fix writes; with `target-torch` set
    # below it, the rule is not run (no rule suggests an API newer than the user's minimum).
    min_torch: ClassVar[tuple[int, int] | None] = None
    # What the rule reads to decide a finding (see rewrite/incremental.py, used by the language
    # server): "component" when a finding inside a top-level statement depends only on the
    # statements it is linked with by name (and the module's header); "file" when it reads facts
    # from anywhere in the file (then every edit re-runs it on the whole text).
    locality: ClassVar[str] = "component"
    # One finding per problem: where a rule named here reports on the same code (the same span),
    # this rule stays silent, for the reason given (code -> why that rule owns the problem). The
    # engine applies it before suppressions, so suppressing either code silences the problem, not half of it.
    yields_to: ClassVar[Mapping[str, str]] = {}

    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider, ParentProvider)
    # Filled provider by provider on demand (get_metadata below), so a dict rather than LibCST's Mapping.
    metadata: dict[type[BaseMetadataProvider[object]], Mapping[cst.CSTNode, object]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own_test = cls.__dict__.get("could_match")
        if isinstance(own_test, classmethod):
            setattr(cls, "could_match", classmethod(_with_source_facts(own_test.__func__)))  # replaces the class's own

    def __init__(self, ctx: RuleContext) -> None:
        super().__init__()
        self.ctx = ctx
        self._wrapper: MetadataWrapper | None = None

    # Metadata on demand: most files a rule visits hold nothing it cares about, and scope and
    # qualified-name analysis cost far more than the parse. A provider is computed for the whole
    # module the first time any rule asks for it (the wrapper caches it for the other rules).
    @contextmanager
    def resolve(self, wrapper: MetadataWrapper) -> Iterator[None]:
        self._wrapper = wrapper
        self.metadata = {}
        try:
            yield
        finally:
            self.metadata = {}
            self._wrapper = None

    def get_visitors(self) -> Mapping[str, Callable[..., Any]]:
        """LibCST's ``get_visitors`` (the visit_/leave_ methods that are not no-op stubs), with the
        names looked up once per class: LibCST runs ``inspect.getmembers`` on every instance, about
        1.7 ms a rule, paid again on every file and on every edit in the language server."""
        cls = type(self)
        names = cls.__dict__.get("_visitor_names")
        if names is None:
            names = _visitor_names(self)
            type.__setattr__(cls, "_visitor_names", names)
        return {name: getattr(self, name) for name in names}

    def get_metadata(self, key, node, default=_UNDEFINED_DEFAULT):
        if key not in self.metadata:
            if key not in self.get_inherited_dependencies():
                raise KeyError(f"{key.__name__} is not declared in {type(self).__name__}.METADATA_DEPENDENCIES")
            if self._wrapper is None:
                raise KeyError(f"{key.__name__}: no MetadataWrapper")
            if key is PositionProvider:  # generated statement by statement as nodes are asked about
                self.metadata[key] = file_positions(self.ctx.facts, self._wrapper)
            else:
                self.metadata[key] = self._wrapper.resolve(key)
        return super().get_metadata(key, node, default)

    @classmethod
    def could_match(cls, text: str) -> bool:
        """The cheap test the engine runs on the raw text before parsing: False means this rule cannot
        report anything in ``text``, so the file is not parsed, resolved or visited for it. The
        default: every ``requires`` substring and one ``prefilter`` substring (if any) occur. Override
        it for a sharper (negative) test, e.g. a regex; it must never say False for a file the rule
        would report on. Keep it a few microseconds: it runs on every file."""
        if cls.requires and not all(tok in text for tok in cls.requires):
            return False
        return not cls.prefilter or any(tok in text for tok in cls.prefilter)

    def option(self, name: str) -> Any:
        return self.ctx.options[name]

    def report(
        self,
        node: cst.CSTNode,
        *,
        fmt: Mapping[str, str] | None = None,
        message: str | None = None,
        replacement: Replacement | Later | None = None,
        target: cst.CSTNode | None = None,
        safety: Safety | None = None,
        tags: Sequence[Tag] = (),
        note: str = "",
        imports: Sequence[ImportSpec] = (),
        fix_title: str | None = None,
    ) -> None:
        """Record a finding. Without ``replacement`` it is display-only. ``safety`` defaults to the
        class's; an unsafe finding must say what it changes through ``tags`` (and ``note``)."""
        fmt = dict(fmt or {})
        msg = (message or self.message).format(**fmt)
        title = fix_title or self.fix_title
        if replacement is None:
            eff_safety = Safety.DISPLAY
        else:
            eff_safety = safety or self.safety
            if eff_safety is Safety.DISPLAY:
                eff_safety = Safety.SAFE
            if tags and eff_safety is Safety.SAFE:
                eff_safety = Safety.UNSAFE
            if eff_safety is Safety.UNSAFE and not tags:
                tags = self.tags
        self.ctx.findings.append(
            Finding(
                rule=type(self),
                node=node,
                message=msg,
                fix_title=title.format(**fmt) if (title and replacement is not None) else None,
                replacement=replacement,
                target=target,
                safety=eff_safety,
                tags=tuple(Tag(t) for t in tags),
                note=note,
                imports=tuple(imports),
            )
        )

    @classmethod
    def summary(cls) -> str:
        """First line of the rule's 'What it does' section."""
        doc = (cls.__doc__ or "").strip().splitlines()
        for line in doc:
            line = line.strip()
            if line and not line.startswith("#"):
                return line
        return cls.message


def _visitor_names(rule: Rule) -> tuple[str, ...]:
    """The names LibCST's own ``get_visitors`` gives (the bound ``visit_*``/``leave_*`` methods that
    are not no-op stubs), read from the rule's own classes: ``inspect.getmembers`` reads thousands of
    attributes (a stub for every node class and field, the rule's examples), which on a one-file
    check cost more than several rules' visits. Every stub comes from LibCST's classes."""
    names = set(vars(rule))
    for klass in type(rule).__mro__:
        if not klass.__module__.startswith("libcst"):
            names.update(vars(klass))
    out = []
    for name in sorted(n for n in names if n.startswith(("visit_", "leave_"))):
        m = getattr(rule, name)
        if inspect.ismethod(m) and m.__name__.startswith(("visit_", "leave_")) and not getattr(m, "_is_no_op", False):
            out.append(name)
    return tuple(out)


def _with_source_facts(text_test: Callable[[Any, str], bool]) -> Callable[[Any, str], bool]:
    """A rule's ``could_match`` reads several facts of one CPython parse of the text and matches their
    nodes by identity; called on its own (an audit, a test), it gets a SourceFacts for the text for
    the length of the call. Inside the engine's analysis of that text, it uses the engine's."""

    @functools.wraps(text_test)
    def could_match(cls: Any, text: str) -> bool:
        current = current_facts()
        if current is not None and current.text is text:
            return text_test(cls, text)
        with analysing(text):
            return text_test(cls, text)

    return could_match
