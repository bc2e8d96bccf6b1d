"""Example scripts and shared page text of the backend-switch rules (cuDNN auto-tuner, TF32 matmuls,
determinism switches). The analysis of the file is in ``program_flags.py``."""
from __future__ import annotations



_ENTRY_DOC = """\
    **Entry script.** A global switch belongs to the program, not to a library, so it is only
    inserted into an *entry script*: a file with a module-level `if __name__ == "__main__":` block,
    or one that calls a module-level `main()` from module level, or one that runs a training loop
    at module level (a module-level `for`/`while` whose body calls `.backward()` or `.step()`).
    The line goes where every process of the program runs it: at the start of the worker that
    `mp.spawn(worker, ...)` (or `Process(target=worker)`) starts, since a spawned process imports
    the script without running its `__main__` block; else at the start of `main()` (after its
    docstring) when the entry calls `main()`, else at the start of the `if __name__ == "__main__":`
    block (torchrun runs it in every process), else right after the module's imports; next to any
    backend switch already there. Files that only define models or helpers are left alone.
    A CUDA program is one that names `cuda`, calls `torch.accelerator`, or moves to a device index
    (`.to(0)`, `.to(gpu_id)`, `.to(local_rank)`)."""

_CONV_SCRIPT = '''\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
    loss.backward()
    opt.step()
'''

_MAIN_SCRIPT = '''\
import torch
from torch import nn


def main():
    """Train."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = nn.Conv1d(4, 4, 3).to(device)
    for _ in range(3):
        net(torch.randn(2, 4, 16, device=device)).sum().backward()


if __name__ == "__main__":
    main()
'''
