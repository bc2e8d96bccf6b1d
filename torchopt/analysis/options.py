"""Options off by default, the other half of the control facts' guards (``analysis/control.py``):
the command-line options of the file (`parser.add_argument("--seed", type=int)`), the fields of its
dataclasses, each with the defaults it is given, and the parameters of its plain functions left at
a default that is off (`def run(save_json=False)` called without it, with `**vars(opt)` of a
`store_true` option, or handed to `fire.Fire`)."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import Assignment, GlobalScope, ScopeProvider

from torchopt.analysis.conditions import FEW, assigns
from torchopt.analysis.names import bindings_of, dotted, qualified_names
from torchopt.analysis.step_loops import HotMap
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule

# Runners that turn a function's parameters into command-line options, each with its default.
CLI_RUNNERS = frozenset(("fire.Fire", "typer.run", "tyro.cli", "jsonargparse.CLI", "clize.run"))


class Options:
    """The options of one file and the parameters off by default (kept by its ``Control``)."""

    def __init__(self, rule: Rule, hot: HotMap) -> None:
        self.rule = rule
        self.hot = hot
        self._options: dict[str, frozenset[str]] | None = None  # option -> the defaults it is given

    def parent(self, node: cst.CSTNode | None) -> cst.CSTNode | None:
        return self.hot.parent(node)

    def off_by_default(self, test: cst.BaseExpression) -> str | None:
        """The option a test reads when it holds only with the option changed from its default:
        `args.augment` (a flag off by default), `args.seed is not None` (an option defaulting to None)."""
        wanted = frozenset(("None", "False"))
        count = self._count_at_default(test)
        if count is not None:
            return count
        if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
            op, right = test.comparisons[0].operator, test.comparisons[0].comparator
            if not (isinstance(op, cst.IsNot) and isinstance(right, cst.Name) and right.value == "None"):
                return None
            test, wanted = test.left, frozenset(("None",))
        if isinstance(test, cst.Name):
            return test.value if self._param_off(test, wanted) or self._global_off(test, wanted) else None
        if not (isinstance(test, cst.Attribute) and isinstance(test.value, cst.Name)):
            return None
        defaults = self.declared().get(test.attr.value)
        return dotted(test) if defaults and defaults <= wanted else None

    def left_at(self, value: cst.BaseExpression, default: str) -> bool:
        """``value`` holds ``default`` (a ``literal`` class: "0", "None", "False") in the program's
        default run: an option of the file given only that default and never assigned after parsing
        (`num_workers=args.dataloader_num_workers` with `default=0`), or such a parameter."""
        return self._left_at_default(value, frozenset((default,)), 0)

    def _count_at_default(self, test: cst.BaseExpression) -> str | None:
        """`args.num_gpu > 1` with `--num-gpu` an integer option whose every default makes the test
        false, and never assigned after parsing: the option read (it holds only when changed)."""
        if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
            return None
        left, op, right = test.left, test.comparisons[0].operator, test.comparisons[0].comparator
        if not (
            isinstance(left, cst.Attribute) and isinstance(left.value, cst.Name) and isinstance(right, cst.Integer)
        ):
            return None
        bound = int(right.evaluated_value)
        holds = {
            cst.GreaterThan: lambda v: v > bound,
            cst.GreaterThanEqual: lambda v: v >= bound,
            cst.LessThan: lambda v: v < bound,
            cst.LessThanEqual: lambda v: v <= bound,
            cst.Equal: lambda v: v == bound,
            cst.NotEqual: lambda v: v != bound,
        }.get(type(op))
        if holds is None:
            return None
        defaults = int_defaults(self.rule.ctx.module, left.attr.value)
        if not defaults or any(holds(d) for d in defaults) or self._option_assigned(left.attr.value):
            return None
        return dotted(left)

    def _left_at_default(self, value: cst.BaseExpression, wanted: frozenset[str], depth: int) -> bool:
        """A value passed on that holds a default in ``wanted`` in the default run: that literal
        (`save_json=False`), an option of the file off by default (`set_seed(args.seed)`), or such a
        parameter of the caller."""
        if isinstance(value, cst.Integer) or (isinstance(value, cst.Name) and value.value in ("None", "False")):
            return literal(value) in wanted
        if isinstance(value, cst.Attribute) and isinstance(value.value, cst.Name):
            defaults = self.declared().get(value.attr.value)
            if not defaults or not defaults <= wanted:
                return False
            return not self._option_assigned(value.attr.value)
        if isinstance(value, cst.Name) and depth < FEW:
            return self._param_off(value, wanted, depth + 1)
        return False

    def _option_assigned(self, attr: str) -> bool:
        """The file assigns the option after parsing it (`opt.save_json |= is_coco`) to anything but
        its off value."""
        for n in walk(self.rule.ctx.module, cross_scopes=True):
            pairs: list[tuple[cst.BaseExpression, cst.BaseExpression | None]] = []
            if isinstance(n, (cst.AugAssign, cst.AnnAssign)):
                pairs = [(n.target, None)]
            elif isinstance(n, cst.Assign):
                for a in n.targets:
                    t, v = a.target, n.value
                    if isinstance(t, cst.Tuple) and isinstance(v, cst.Tuple) and len(t.elements) == len(v.elements):
                        pairs += [(te.value, ve.value) for te, ve in zip(t.elements, v.elements)]
                    elif isinstance(t, cst.Attribute):
                        pairs.append((t, v))
                    else:
                        pairs += [(e, None) for e in walk(t) if isinstance(e, cst.Attribute)]
            for target, value in pairs:
                if isinstance(target, cst.Attribute) and target.attr.value == attr:
                    if value is None or literal(value) not in ("None", "False"):
                        return True
        return False

    def _global_off(self, name: cst.Name, wanted: frozenset[str]) -> bool:
        """``name`` is a module-level switch of the file, every assignment of which (at module level, or
        under ``global``) gives it a literal in ``wanted``: `profile = False` at the top of a script whose
        command line or config file may turn it on (nanoGPT's configurator)."""
        bindings = bindings_of(self.rule, name)
        if not bindings:
            return False
        for b in bindings:
            if not isinstance(b, Assignment) or not isinstance(b.scope, GlobalScope):
                return False
            target = self.parent(b.node)
            stmt = self.parent(target) if isinstance(target, cst.AssignTarget) else None
            if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and literal(stmt.value) in wanted):
                return False
            if not isinstance(stmt.value, cst.Name):
                return False  # (None or False, as written: not a default computed from something)
        return True

    def _param_off(self, name: cst.Name, wanted: frozenset[str], depth: int = 0) -> bool:
        """``name`` is a parameter of a plain function of the file with a default in ``wanted``
        (`def main(save_json: bool = False)`), the function never assigns it, and every use of the
        function's name leaves it at that default: a call of the file that does not pass it (nor
        `*args`/`**kwargs`), or the function handed to a command-line runner (`fire.Fire(main)`,
        `typer.run(main)`), whose default run is the default. An exported function, a use of its name
        of any other kind, or no use at all: unknown."""
        bindings = bindings_of(self.rule, name)
        if not bindings or len(bindings) != 1:
            return False
        param = getattr(bindings[0], "node", None)
        fn = self.parent(self.parent(param))  # Param -> Parameters -> FunctionDef
        if not (isinstance(param, cst.Param) and isinstance(fn, cst.FunctionDef)):
            return False
        if param.default is None or literal(param.default) not in wanted or param.star:
            return False
        if id(fn) in self.hot.method_class or fn.name.value in exported(self.rule.ctx.module):
            return False
        if assigns(fn.body, name.value):
            return False
        params = fn.params
        positional = [p.name.value for p in (*params.posonly_params, *params.params)]
        index = positional.index(name.value) if name.value in positional else None
        try:
            scope = self.rule.get_metadata(ScopeProvider, fn)
        except KeyError:
            return False
        if scope is None:
            return False
        uses = [r.node for a in scope.assignments[fn.name.value] for r in a.references]
        if not uses:
            return False
        for use in uses:
            parent = self.parent(use)
            if isinstance(parent, cst.Call) and parent.func is use:
                for a in parent.args:
                    owner = vars_of(a.value) if a.star == "**" else None
                    if a.star and owner is None:
                        return False
                    # `run(**vars(opt))`: the option of that name is the value passed
                    if owner is not None and not self._left_at_default(
                        cst.Attribute(owner, cst.Name(name.value)), wanted, depth
                    ):
                        return False
                passed = [a for a in parent.args if a.keyword is None]
                given = [a for a in parent.args if a.keyword is not None and a.keyword.value == name.value]
                if index is not None and len(passed) > index:
                    given.append(passed[index])
                if any(not self._left_at_default(a.value, wanted, depth) for a in given):
                    return False
                continue
            arg = parent if isinstance(parent, cst.Arg) else None
            runner = self.parent(arg) if arg is not None else None
            if (
                isinstance(runner, cst.Call)
                and runner.args
                and runner.args[0] is arg
                and qualified_names(self.rule, runner.func) & CLI_RUNNERS
            ):
                continue
            return False
        return True

    def declared(self) -> dict[str, frozenset[str]]:
        """The command-line options of the file (`parser.add_argument("--seed", type=int)`) and the
        fields of its dataclasses (`seed: int = 1`, the options of `tyro.cli(Args)`), each with the
        defaults it is given: "None", "False" or "other" (a name given twice keeps both)."""
        if self._options is None:
            found: dict[str, set[str]] = {}
            for node in walk(self.rule.ctx.module, cross_scopes=True):
                for name, default in declared_options(node):
                    found.setdefault(name, set()).add(default)
            self._options = {k: frozenset(v) for k, v in found.items()}
        return self._options


def exported(module: cst.Module) -> frozenset[str]:
    """The names a module lists in ``__all__`` (other modules may call them)."""
    out: set[str] = set()
    for stmt in module.body:
        for s in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(s, (cst.Assign, cst.AugAssign)) and "__all__" in [
                dotted(t.target) for t in getattr(s, "targets", ())
            ] + [dotted(getattr(s, "target", None))]:
                value = s.value
                if isinstance(value, (cst.List, cst.Tuple)):
                    out.update(
                        e.value.evaluated_value
                        for e in value.elements
                        if isinstance(e.value, cst.SimpleString) and isinstance(e.value.evaluated_value, str)
                    )
    return frozenset(out)


def vars_of(expr: cst.BaseExpression) -> cst.Name | None:
    """`opt` of `vars(opt)`: the options object whose attributes a `**vars(opt)` call passes."""
    if (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Name)
        and expr.func.value == "vars"
        and len(expr.args) == 1
        and isinstance(expr.args[0].value, cst.Name)
    ):
        return expr.args[0].value
    return None


def literal(expr: cst.BaseExpression | None) -> str:
    """The default an option or parameter is given, as far as the facts tell them apart: "None",
    "False", "0" (no worker processes, no warm-up steps) or "other"."""
    if expr is None or (isinstance(expr, cst.Name) and expr.value == "None"):
        return "None"
    if isinstance(expr, cst.Name) and expr.value == "False":
        return "False"
    if isinstance(expr, cst.Integer) and expr.evaluated_value == 0:
        return "0"
    return "other"


def declared_options(node: cst.CSTNode) -> list[tuple[str, str]]:
    """The (option, default) pairs ``node`` declares: an ``add_argument`` call (its `dest`, or its
    first long flag), or a dataclass's annotated fields with a value."""
    if isinstance(node, cst.ClassDef):
        if not any(
            (dotted(d.decorator if not isinstance(d.decorator, cst.Call) else d.decorator.func) or "").endswith(
                "dataclass"
            )
            for d in node.decorators
        ):
            return []
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
        return [
            (s.target.value, literal(s.value))
            for line in body
            if isinstance(line, cst.SimpleStatementLine)
            for s in line.body
            if isinstance(s, cst.AnnAssign) and isinstance(s.target, cst.Name) and s.value is not None
        ]
    if not (
        isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "add_argument"
    ):
        return []
    kw = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
    flags: list[str] = []
    for a in node.args:
        value = a.value.evaluated_value if a.keyword is None and isinstance(a.value, cst.SimpleString) else None
        if isinstance(value, str):
            flags.append(value)
    dest = _dest(kw, flags)
    if dest is None:
        return []
    action = kw.get("action")
    act = action.evaluated_value if isinstance(action, cst.SimpleString) else None
    required = kw.get("required")
    if required is not None and not (isinstance(required, cst.Name) and required.value == "False"):
        return [(dest, "other")]
    if act in ("store_true", "store_false"):
        default = literal(kw["default"]) if "default" in kw else ("False" if act == "store_true" else "other")
        return [(dest, default)]
    if action is not None and act not in ("store", "append", "count"):
        return [(dest, "other")]
    return [(dest, literal(kw.get("default")))]


def _dest(kw: dict[str, cst.BaseExpression], flags: list[str]) -> str | None:
    """The attribute an ``add_argument`` call stores into: its `dest`, or its first long flag."""
    dest_node = kw.get("dest")
    if isinstance(dest_node, cst.SimpleString) and isinstance(dest_node.evaluated_value, str):
        return dest_node.evaluated_value
    long = [f for f in flags if f.startswith("--")] or [f for f in flags if not f.startswith("-")]
    return long[0].lstrip("-").replace("-", "_") if long else None


def int_defaults(module: cst.Module, attr: str) -> list[int] | None:
    """The integer defaults the file's ``add_argument`` calls give the option ``attr`` (`--num-gpu`,
    `type=int, default=1`), or None when one of them is not an integer literal or none declares it."""
    found: list[int] = []
    for node in walk(module, cross_scopes=True):
        if not (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "add_argument"
        ):
            continue
        kw = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        flags = [
            a.value.evaluated_value
            for a in node.args
            if a.keyword is None and isinstance(a.value, cst.SimpleString) and isinstance(a.value.evaluated_value, str)
        ]
        if _dest(kw, [f for f in flags if isinstance(f, str)]) != attr:
            continue
        default = kw.get("default")
        if not isinstance(default, cst.Integer) or "action" in kw or "required" in kw:
            return None
        found.append(int(default.evaluated_value))
    return found or None
