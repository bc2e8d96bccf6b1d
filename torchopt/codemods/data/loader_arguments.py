"""DataLoader construction: TOP701 `num_workers`, TOP702 `pin_memory`,
TOP703 `persistent_workers`."""

from __future__ import annotations


import libcst as cst

from torchopt.analysis.syntax import source
from torchopt.codemods.data.loader_analysis import LoaderRule

# What TOP701 writes when no `num-workers` option is set (TOP703 recognises them as > 0).
AUTO_WORKERS = "min(8, os.cpu_count() or 1)"
AUTO_WORKERS_DISTRIBUTED = 'min(8, max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))'


def _replace_arg(call: cst.Call, arg: cst.Arg, value: cst.BaseExpression) -> cst.Call:
    return call.with_changes(args=[a.with_changes(value=value) if a is arg else a for a in call.args])


def _loader_text(rule: LoaderRule, call: cst.Call) -> str:
    return source(rule, call.func) + "(...)"
