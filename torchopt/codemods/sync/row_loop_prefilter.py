"""TOP610's prefilter: a cheap look at the raw text and at CPython's ast that rules out most
files before LibCST parses them. Each test is a necessary condition of a report, never a guess."""

from __future__ import annotations

import ast
import re

from torchopt.codemods.sync.row_loop_tensors import TENSOR_METHODS

# What `row_header` can match, on the raw text: `x.size(0)`, `x.shape[0]`, `len(x)`, `in x:`, `enumerate(x)`.
HEADER_TEXT = re.compile(r"\.size\(\s*0\s*\)|\.shape\[\s*0\s*\]|\blen\(|\bin\s+\w+\s*[:)]|enumerate\(\s*\w+\s*\)")


def reports_possible(text: str) -> bool:
    """Cheap necessary condition on CPython's ast for a report: a function the rule reads (a
    `forward`/`__call__` defined in a class body, or a function named like a loss) that holds a loop
    or `sum(...)` generator with a row header `row_header` could accept (a loop over a bare name
    also needs a sign that the name holds a tensor), or, in a `__call__`/`forward` of a class named
    `...Loss`, any branch. True when the text does not parse."""
    from torchopt.analysis.precheck.tree import ast_index, nodes_of

    index = ast_index(text)
    if index is None:
        return True
    classes = index.get(ast.ClassDef, ())
    if not any(c.name.endswith("Loss") for c in classes):
        # First over the whole file, taking every name for a tensor: most files end here.
        sums = [
            c
            for c in index.get(ast.Call, ())
            if isinstance(c.func, ast.Name) and c.func.id == "sum" and isinstance(_only_arg(c), ast.GeneratorExp)
        ]
        if not any(
            _ast_row_header(n.iter, n.target, None, n.body) for n in nodes_of(index, ast.For, ast.AsyncFor)
        ) and not any(
            _ast_row_header(g.iter, g.target, None, None) for g in (_only_arg(c).generators[0] for c in sums)
        ):
            return False
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for cls in classes:
        for fn in cls.body:
            if (
                isinstance(fn, funcs)
                and fn.name in ("forward", "__call__")
                and (fn.name == "forward" or cls.name.endswith("Loss"))
                and _row_code_possible(fn, loss_module=cls.name.endswith("Loss"))
            ):
                return True
    return any(
        any(w in fn.name.lower() for w in ("loss", "criterion")) and _row_code_possible(fn, loss_module=False)
        for fn in nodes_of(index, *funcs)
    )


def _row_code_possible(fn, loss_module: bool) -> bool:
    """Whether ``fn`` may hold a row loop the rule accepts (or, in a loss module, any branch)."""
    nodes = list(ast.walk(fn))
    if loss_module and any(isinstance(n, (ast.If, ast.While, ast.IfExp, ast.Assert)) for n in nodes):
        return True
    # Names that may surely hold a tensor: annotated `Tensor`, assigned, or used with a tensor method.
    sure = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    sure |= {
        a.arg
        for a in ast.walk(fn.args)
        if isinstance(a, ast.arg) and a.annotation is not None and "Tensor" in ast.unparse(a.annotation)
    }
    sure |= {
        n.value.id
        for n in nodes
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr in TENSOR_METHODS
    }
    for n in nodes:
        if isinstance(n, (ast.For, ast.AsyncFor)):
            if _ast_row_header(n.iter, n.target, sure, n.body):
                return True
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "sum"
            and isinstance(_only_arg(n), ast.GeneratorExp)
        ):
            gen = _only_arg(n).generators[0]
            if _ast_row_header(gen.iter, gen.target, sure, None):
                return True
    return False


def _only_arg(call):
    """The value of a call's one argument however it is passed (LibCST counts keywords and stars
    as arguments too), else None."""
    if len(call.args) + len(call.keywords) != 1:
        return None
    value = call.args[0] if call.args else call.keywords[0].value
    return value.value if isinstance(value, ast.Starred) else value


def _ast_row_header(it, target, sure: set[str] | None, body) -> bool:
    """`row_header` and `PythonLoopOverTensor._row_loop` on CPython's ast, looser: no tensor facts beyond ``sure``
    (None: any name may hold a tensor)."""

    def indexes(index: str) -> bool:  # `t[index]` / `t[index, ...]` in the loop body
        if body is None:
            return True
        for n in (x for stmt in body for x in ast.walk(stmt)):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                first = n.slice.elts[0] if isinstance(n.slice, ast.Tuple) and n.slice.elts else n.slice
                if isinstance(first, ast.Name) and first.id == index:
                    return True
        return False

    if (
        isinstance(it, ast.Call)
        and isinstance(it.func, ast.Name)
        and it.func.id == "range"
        and _only_arg(it) is not None
        and isinstance(target, ast.Name)
    ):
        bound = _only_arg(it)
        sized = (
            isinstance(bound, ast.Call)
            and isinstance(bound.func, ast.Attribute)
            and bound.func.attr == "size"
            and isinstance(bound.func.value, ast.Name)
        )
        shaped = (
            isinstance(bound, ast.Subscript)
            and isinstance(bound.value, ast.Attribute)
            and bound.value.attr == "shape"
            and isinstance(bound.value.value, ast.Name)
        )
        counted = (
            isinstance(bound, ast.Call)
            and isinstance(bound.func, ast.Name)
            and bound.func.id == "len"
            and len(bound.args) == 1
            and isinstance(bound.args[0], ast.Name)
            and (sure is None or bound.args[0].id in sure)
        )
        return (sized or shaped or counted) and indexes(target.id)
    if isinstance(it, ast.Name) and (sure is None or it.id in sure) and isinstance(target, ast.Name):
        return True
    if (
        isinstance(it, ast.Call)
        and isinstance(it.func, ast.Name)
        and it.func.id == "enumerate"
        and isinstance(_only_arg(it), ast.Name)
        and (sure is None or _only_arg(it).id in sure)
        and isinstance(target, (ast.Tuple, ast.List))
        and len(target.elts) == 2
    ):
        return True
    return False
