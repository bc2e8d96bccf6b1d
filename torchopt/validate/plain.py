"""Runs a script as the user would, with only the write guard (an audit hook, which neither
tracing, scripting nor compilation can see, and checks before torch.save and torch.jit.save):
the check that a failure under the harness is the harness's.

    python -m torchopt.validate.plain PROTECT_JSON SCRIPT ARGS...
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main(argv: list[str]) -> None:
    from torchopt.validate.harness import guard_writes

    protect = json.loads(argv[0])
    script = argv[1]
    import torch  # the savers that write from C++ are checked too; nothing else of torch is touched

    guard_writes(torch, protect, [os.path.dirname(os.path.realpath(script))])
    sys.argv = [script, *argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
