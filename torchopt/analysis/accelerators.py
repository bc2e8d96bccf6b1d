"""Whether a program's tensors can be on an accelerator: the program-level half of the value facts.

A host read (``t.item()``, ``t.numpy()``) waits for a device only when ``t`` can be on one. A
program that never selects an accelerator keeps every tensor on the host, whatever the analysis
knows about each value. :func:`host_program` says so, with its reason, when all of these hold:

* the analysed file is run as a program (``if __name__ == "__main__":``); a module without that
  guard is one that other code imports and may hand tensors on a device;
* the analysed file neither names an accelerator (``cuda``, ``mps``, ``xpu``, ``torch.accelerator``,
  an accelerate ``Accelerator``, a trainer that picks the device, ``device_map=``, ``gpu``) nor
  places anything on a device chosen elsewhere (``.to(device)``, ``device=dev`` where ``dev`` is not
  the CPU: a helper's return value, a command-line option, an environment variable);
* it has no device option (a ``--device`` flag or a ``device`` parameter can be given ``cuda``
  whatever its default);
* it loads no tensors whose device was recorded with them (``torch.load`` without
  ``map_location``: a checkpoint saved on a GPU loads back onto it);
* every module of the project it imports, directly or through other project modules, says none of
  this either (nor the word ``device``: a module that picks a device for its caller); a module the
  run may not read makes the answer unknown.

Anything else is "may be on an accelerator" (``None``): the rules keep their findings. Facts about
a file are made once per analysed text (``SourceFacts.derived``); what is read of other modules is
recorded through the project scope, so a change there drops this file's cached result.
"""

from __future__ import annotations

import re

import libcst as cst
from libcst.metadata import PositionProvider

from torchopt.analysis.names import dotted
from torchopt.analysis.project import Unknown, index_of
from torchopt.analysis.syntax import walk
from torchopt.analysis.values import DeviceKind, classify_device, string_value
from torchopt.rewrite.facts import source_of
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# Text that means an accelerator may be chosen: its APIs, device strings, and the objects that pick
# the device for the program (Lightning/transformers trainers, accelerate, `device_map=`).
ACCELERATOR_TEXT = re.compile(r"cuda|\bmps\b|xpu|[aA]ccelerator|\bTrainer\b|\bgpus?\b|device_map")
# A load that restores tensors where they were saved (no `map_location=`).
_LOAD = re.compile(r"\b(?:torch|jit|hub)\.load\(")
_IMPORTED_SIGN = re.compile(ACCELERATOR_TEXT.pattern + r"|device")
_MAX_MODULES = 64


def _line(rule: Rule, node: cst.CSTNode) -> int:
    return rule.get_metadata(PositionProvider, node).start.line


def _placements(module: cst.Module) -> list[cst.BaseExpression]:
    """The device expressions the program places work on: `.to(dev)`, `device=dev`, `set_default_device(dev)`."""
    out: list[cst.BaseExpression] = []
    for node in walk(module, cross_scopes=True):
        if not isinstance(node, cst.Call):
            continue
        out.extend(a.value for a in node.args if a.keyword is not None and a.keyword.value == "device")
        method = node.func.attr.value if isinstance(node.func, cst.Attribute) else ""
        first = node.args[0] if node.args else None
        if method in ("to", "set_default_device") and first is not None and first.keyword is None and not first.star:
            out.append(first.value)
    return out


def device_flag_default(rule: Rule, module: cst.Module, skip_passed: bool = False) -> tuple[str, int] | None:
    """The default of a `--device` command-line option or a `device` parameter, with its line.
    ``skip_passed``: not the default of a parameter that a call of the file passes
    (`load_cora(device=device)` of `def load_cora(path, device="cpu")`): the caller chooses it."""
    for node in walk(module, cross_scopes=True):
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "add_argument"
            and node.args
        ):
            flag = string_value(node.args[0].value) or ""
            if "device" in flag or flag in ("--dev", "--accel"):
                default = next((a.value for a in node.args if a.keyword and a.keyword.value == "default"), None)
                return (string_value(default) or "?"), _line(rule, node)
        if isinstance(node, cst.Param) and node.default is not None and "device" in node.name.value:
            if skip_passed and _passed(rule, module, node):
                continue
            return (string_value(node.default) or "?"), _line(rule, node)
    return None


def _passed(rule: Rule, module: cst.Module, param: cst.Param) -> bool:
    """A call of the file passes ``param`` to its function, by keyword or by position."""
    fn = rule.get_metadata(ParentProvider, rule.get_metadata(ParentProvider, param, None), None)
    if not isinstance(fn, cst.FunctionDef):
        return False
    positional = [p.name.value for p in (*fn.params.posonly_params, *fn.params.params)]
    index = positional.index(param.name.value) if param.name.value in positional else None
    for call in walk(module, cross_scopes=True):
        if not (isinstance(call, cst.Call) and dotted(call.func) in (fn.name.value, f"self.{fn.name.value}")):
            continue
        if any(a.keyword is not None and a.keyword.value == param.name.value for a in call.args):
            return True
        given = [a for a in call.args if a.keyword is None and not a.star]
        if index is not None and len(given) > index:
            return True
    return False


def no_accelerator_named(rule: Rule, module: cst.Module) -> str | None:
    """Why nothing in ``module`` selects an accelerator (its device option aside), or None."""
    if ACCELERATOR_TEXT.search(source_of(module)):
        return None
    cpu_line = None
    for expr in _placements(module):
        device = classify_device(rule, expr)
        if device.kind in (DeviceKind.DTYPE, DeviceKind.CONVENTION):
            continue  # a cast, or a device that follows another tensor or the caller
        if not (device.is_device and device.is_cpu):
            return None  # placed on a device chosen elsewhere (a helper, a launcher)
        cpu_line = cpu_line or _line(rule, expr)
    if cpu_line is not None:
        return f'it places its tensors on "cpu" (line {cpu_line}) and never selects an accelerator'
    return "nothing in it selects an accelerator"


def host_program(rule: Rule) -> str | None:
    """Why every tensor of the program that ``rule``'s file runs is on the host, or None when some may
    be on an accelerator or that is not established (see the module's docstring)."""
    return rule.ctx.facts.derived(("host program",), lambda: _host_program(rule))


def _host_program(rule: Rule) -> str | None:
    module = rule.ctx.module
    if not any(_is_main_guard(s) for s in module.body):
        return None  # a module others import: a caller may hand it tensors on a device
    if device_flag_default(rule, module) is not None:
        return None
    why = no_accelerator_named(rule, module)
    if why is None or _loads_saved_devices(rule.ctx.text):
        return None
    if not _imports_name_no_accelerator(rule):
        return None
    return why


def _is_main_guard(stmt: cst.BaseStatement) -> bool:
    test = stmt.test if isinstance(stmt, cst.If) else None
    return (
        isinstance(test, cst.Comparison)
        and isinstance(test.left, cst.Name)
        and test.left.value == "__name__"
        and any(string_value(c.comparator) == "__main__" for c in test.comparisons)
    )


def _loads_saved_devices(text: str) -> bool:
    return bool(_LOAD.search(text)) and "map_location" not in text


def _imports_name_no_accelerator(rule: Rule) -> bool:
    """No project module the file imports (transitively) can choose a device; False when one may or
    cannot be read."""
    index = index_of(rule)
    if index.path is None:
        return True  # no project around the text: only its own imports, which are libraries
    todo = [(index.path, index.own)]
    seen = {index.path}
    while todo:
        path, summary = todo.pop()
        for module, name, level in summary.imports.values():
            files = [index.module_file(f"{module}.{name}" if name else module, level, path)]
            if name and files[0] is None:
                files.append(index.module_file(module, level, path))
            for got in files:
                if got is None or (isinstance(got, str) and got in seen):
                    continue
                if isinstance(got, Unknown) or len(seen) >= _MAX_MODULES:
                    return False
                seen.add(got)
                text = index.scope.text(got)
                sub = index.summary(got)
                if text is None or sub is None or not sub.parsed:
                    return False
                if _IMPORTED_SIGN.search(text) or _loads_saved_devices(text):
                    return False
                todo.append((got, sub))
    return True
