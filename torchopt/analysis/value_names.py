"""Names the value facts (``placement.py``) know by their spelling: torch factories, progress bars,
builtins and methods whose results are Python values, and the libraries that compute on the host."""

from __future__ import annotations

FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "as_tensor",
    "from_numpy",
    "from_file",  # read from a file, or a buffer, into host memory
    "frombuffer",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
}
PROGRESS = {
    f"{m}.{f}" for m in ("tqdm", "tqdm.auto", "tqdm.std", "tqdm.notebook", "tqdm.rich") for f in ("tqdm", "trange")
} | {"rich.progress.track", "ultralytics.utils.TQDM"}  # (ultralytics' TQDM subclasses tqdm.tqdm)
INT_BUILTINS = {"len", "int", "ord", "hash", "id"}
STR_METHODS = {"format", "join", "replace", "strip", "lstrip", "rstrip", "lower", "upper", "zfill", "ljust", "rjust"}
INT_METHODS = {"numel", "dim", "ndimension", "element_size", "nelement", "get_device"}
HOST_LIBRARIES = {"numpy", "scipy"}
