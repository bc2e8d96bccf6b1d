"""Runs a script as ``__main__`` in one torchrun rank and records what that rank did: the files it
opened for writing (``open`` and ``torch.save``), what it printed and logged, and the parameters of
every optimizer that stepped (so models local to ``main()`` are seen too).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_support.py SCRIPT OUT_DIR

Each rank writes OUT_DIR/rank<R>.pt: {"params": [tensor, ...], "writes": [path, ...],
"stdout": str, "stderr": str}.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys


def main() -> int:
    script, out_dir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    import torch
    import torch.optim.optimizer as optim_mod

    torch.set_num_threads(1)
    writes: list[str] = []
    real_open, real_save = builtins.open, torch.save

    def recording_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            writes.append(os.path.abspath(os.fspath(file)))
        return real_open(file, mode, *args, **kwargs)

    def recording_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(f, (str, os.PathLike)):
            writes.append(os.path.abspath(os.fspath(f)))
        return real_save(obj, f, *args, **kwargs)

    optimizers: list = []

    def seen(opt, args, kwargs):  # type: ignore[no-untyped-def]
        if not any(o is opt for o in optimizers):
            optimizers.append(opt)

    optim_mod.register_optimizer_step_post_hook(seen)
    builtins.open, torch.save = recording_open, recording_save
    out, err = io.StringIO(), io.StringIO()
    old_out, old_err, old_argv = sys.stdout, sys.stderr, sys.argv
    sys.stdout, sys.stderr, sys.argv = out, err, [script]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout, sys.stderr, sys.argv = old_out, old_err, old_argv
        builtins.open, torch.save = real_open, real_save
    params = [p.detach().cpu().clone() for opt in optimizers for g in opt.param_groups for p in g["params"]]
    torch.save(
        {"params": params, "writes": sorted(set(writes)), "stdout": out.getvalue(), "stderr": err.getvalue()},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    sys.stderr.write(err.getvalue())
    return 0


if __name__ == "__main__":
    code = main()
    # Everything the tests compare is saved above. Skip interpreter teardown: gloo's threads can abort
    # it ("terminate called without an active exception", seen once on a loaded 2-core machine after
    # the script had finished and destroyed its process group), which says nothing about the rewrite.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
