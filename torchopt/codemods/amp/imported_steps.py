"""Training steps that run in another module of the project (``from engine import train_one_epoch``).

The loop of this file calls an imported function and hands it an optimizer created here; the
forward, the loss and ``backward()`` are in that other file, which one file's analysis does not read.
The rule says so, naming the file, rather than staying silent: inserting AMP there needs the
definition of the step and the creation of its optimizer in one analysis. The project index rules
out what is no step (a function that only sets each param group's learning rate runs no
``backward()``, nor does anything it calls) and a step that already runs under the program's own
autocast or GradScaler (named by it or by a project function it calls)."""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.names import dotted, qualified_names
from torchopt.analysis.project import Definition, index_of
from torchopt.analysis.syntax import walk
from torchopt.analysis.statement_edits import body_list


def imported_steps(analysis) -> list[tuple[cst.Call, str, str]]:
    """(call, function as written, module file) for each call in a loop body of a function imported from
    another module, passed an optimizer this file creates, where that loop runs no backward itself."""
    out = []
    for loop in analysis.all_nodes:
        if not isinstance(loop, (cst.For, cst.While)):
            continue
        body = body_list(loop.body) or ()
        if any(
            isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward"
            for s in body
            for n in walk(s)
        ):
            continue
        for s in body:
            small = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
            value = getattr(small, "value", None)
            if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Name, cst.Attribute)):
                continue
            module = _imported_from(analysis, value.func)
            if module is None:
                continue
            if any(
                not a.star and (k := analysis.key(dotted(a.value), a.value)) is not None and k in analysis.koptimizers
                for a in value.args
            ):
                written = analysis.module.code_for_node(value.func)
                if not _float32_step(analysis, written):
                    continue
                out.append((value, written, module))
    return out


def _float32_step(analysis, written: str) -> bool:
    """False when the project index shows that ``written`` runs no training step, or runs one under
    mixed precision already; True otherwise (also when the index cannot tell)."""
    index = index_of(analysis.rule)
    found = index.resolve(written)
    if not isinstance(found, Definition) or found.kind != "function":
        return True
    return index.runs(found, "steps") is not False and index.runs(found, "amp") is not True


def _imported_from(analysis, func: cst.BaseExpression) -> str | None:
    """``engine.py`` for a function imported as ``from engine import f`` / ``from .engine import f`` /
    ``import engine`` (``engine.f``); None for torch, for the file's own functions, or when unknown."""
    names = qualified_names(analysis.rule, func)
    if len(names) != 1:
        return None
    q = names.pop()
    parts = q.lstrip(".").split(".")
    if len(parts) < 2 or parts[0] in ("torch", "torchvision", "torchaudio", "numpy"):
        return None
    return "/".join(parts[:-1]) + ".py"
