"""`python -m torchopt`. Python puts the current folder first on ``sys.path`` for ``-m``, so a user's
``typer.py`` or ``libcst.py`` there would be imported in place of the real ones (and run): take it
off before importing anything else, as the ``torchopt`` console script never has it."""

import os
import sys


def _drop_current_folder() -> None:
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return  # -P / PYTHONSAFEPATH: nothing was added
    try:
        here = os.getcwd()
    except OSError:  # the folder was deleted: nothing can be imported from it anyway
        here = None
    if sys.path[0] in ("", os.curdir) or os.path.abspath(sys.path[0]) == here:
        del sys.path[0]


_drop_current_folder()

from torchopt.cli import main  # noqa: E402  (only now that the user's folder is off the path)

main()
