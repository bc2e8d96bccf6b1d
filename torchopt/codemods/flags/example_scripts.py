"""Page text shared by the backend-switch rules (cuDNN auto-tuner, TF32 matmuls,
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
