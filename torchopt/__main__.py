"""`python -m torchopt` and the `torchopt` command.

Python puts the current folder first on ``sys.path`` for ``-m``, so a user's ``typer.py`` or
``libcst.py`` there would be imported in place of the real ones (and run): take it off before
importing anything else, as the ``torchopt`` console script never has it.

The commands a pre-commit hook, an editor's formatter-style filter and an editor's language client
start over and over (`check FILES`, `check -`, `rewrite -`, `lsp`) are read here without typer,
whose import costs as much as parsing a file: :func:`quick_args` understands their plain spellings
and hands anything else (help, `--version`, abbreviations typer would reject, a repeated option, any
other command) to typer, which then prints exactly what it always did. Both call the same functions
(torchopt/commands.py), so output and exit codes do not depend on which one read the arguments.
"""

import os  # only modules Python has loaded already: the user's folder is still on the path here
import sys

# option -> (keyword, kind): a flag sets True (_OFF: False), a value takes the next word (or
# `=VALUE`), a list value may be repeated
_FLAG, _OFF, _VALUE, _LIST, _JOBS = "flag", "off", "value", "list", "jobs"
_SHARED = {
    "--unsafe-fixes": ("unsafe_fixes", _FLAG),
    "--no-unsafe-fixes": ("unsafe_fixes", _OFF),
    "--select": ("select", _LIST),
    "--extend-select": ("extend_select", _LIST),
    "--ignore": ("ignore", _LIST),
    "--jobs": ("jobs", _JOBS),
    "-j": ("jobs", _JOBS),
    "--output-format": ("output_format", _VALUE),
    "--stdin-filename": ("stdin_filename", _VALUE),
    "--config": ("config", _VALUE),
    "--quiet": ("quiet", _FLAG),
    "-q": ("quiet", _FLAG),
    "--no-cache": ("no_cache", _FLAG),
    "--cache-dir": ("cache_dir", _VALUE),
}
OPTIONS = {
    "check": {
        **_SHARED,
        "--fix": ("fix", _FLAG),
        "--show-fixes": ("show_fixes", _FLAG),
        "--exit-zero": ("exit_zero", _FLAG),
        "-e": ("exit_zero", _FLAG),
        "--statistics": ("statistics", _FLAG),
        "--add-noqa": ("add_noqa", _FLAG),
        "--output-file": ("output_file", _VALUE),
        "-o": ("output_file", _VALUE),
        "--profile": ("profile", _VALUE),
    },
    # without --validate and its options, which run programs (typer reads those)
    "rewrite": {**_SHARED, "--diff": ("diff", _FLAG), "--check": ("check", _FLAG)},
}


def quick_args(argv: "list[str]") -> "tuple[str, dict[str, object]] | None":
    """``argv`` (without the program name) as (command, keyword arguments of its function in
    torchopt/commands.py), or None when typer must read it: anything but the plain spellings of
    `check`, `rewrite` and `lsp` (an option written `--name VALUE`, `--name=VALUE` or a short one
    alone, each at most once; a value that does not look like an option; no `--`; no help)."""
    if argv == ["lsp"]:
        return "lsp", {}
    if not argv or argv[0] not in OPTIONS:
        return None
    known = OPTIONS[argv[0]]
    kwargs: "dict[str, object]" = {}
    lists: "dict[str, list[str]]" = {}  # the values of options that may be repeated
    paths: "list[str]" = []
    words = iter(argv[1:])
    for word in words:
        if word == "-" or not word.startswith("-"):
            paths.append(word)
            continue
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if name not in known:
            return None
        key, kind = known[name]
        if key in kwargs:
            return None  # typer's rule for a repeated option (the last one wins) is left to typer
        if kind in (_FLAG, _OFF):
            if eq:
                return None
            kwargs[key] = kind == _FLAG
            continue
        if not eq:
            value = next(words, "-")
        if value.startswith("-"):
            return None  # a missing value, or one typer might read as an option
        if kind == _JOBS:
            if not (value.isascii() and value.isdigit() and int(value) >= 1):
                return None
            kwargs[key] = int(value)
        elif kind == _LIST:
            lists.setdefault(key, []).append(value)
        else:
            kwargs[key] = value
    kwargs.update(lists)
    if paths:
        kwargs["paths"] = paths
    return argv[0], kwargs


def main() -> None:
    """The `torchopt` command: the commands :func:`quick_args` reads run without importing typer;
    every other goes through typer (torchopt.cli)."""
    from torchopt.rewrite import dataclass_code

    dataclass_code.install()  # before LibCST is imported: its dataclasses are most of them
    quick = quick_args(sys.argv[1:])  # never reads `--`, the one thing split_script_args rewrites
    if quick is None:
        from torchopt.cli import main as typer_main

        typer_main()
        return
    import gc

    # An analysis process (runner.tune_gc), from the first import on: importing LibCST and the rules
    # makes tens of thousands of objects, none of them garbage, that the default thresholds scan again
    # and again.
    gc.set_threshold(100_000, 50, 100)
    from torchopt import commands
    from torchopt.rewrite import speedups

    speedups.install()  # this process's LibCST only: importing torchopt changes nothing
    command, kwargs = quick
    run = getattr(commands, command)
    try:
        commands.run_command(lambda: sys.exit(run(**kwargs)), serving=command == "lsp")
    except SystemExit as done:
        if command != "lsp":
            leave(done.code)
        raise


def leave(code: object) -> None:
    """Exit with ``code`` without Python's teardown of every object and module one by one (the
    LibCST tree of the file, every rule's module: about a twentieth of a one-file check). What the
    teardown would do that anyone could notice is done first: the ``atexit`` functions run and the
    standard streams are flushed. Returns (the caller exits as usual) when a process pool or another
    thread is still about, under a profiler or tracer, when ``code`` is not a plain exit status, or
    when a stream cannot be flushed (its error is then reported by Python's own exit)."""
    import threading

    if not (code is None or isinstance(code, int)) or "concurrent.futures" in sys.modules:
        return
    if threading.active_count() > 1 or sys.getprofile() is not None or sys.gettrace() is not None:
        return  # a profiler or coverage writes its data when the program returns
    import atexit

    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code or 0)


def _drop_current_folder() -> None:
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return  # -P / PYTHONSAFEPATH: nothing was added
    try:
        here = os.getcwd()
    except OSError:  # the folder was deleted: nothing can be imported from it anyway
        here = None
    if sys.path[0] in ("", os.curdir) or os.path.abspath(sys.path[0]) == here:
        del sys.path[0]


if __name__ == "__main__":
    _drop_current_folder()
    main()
