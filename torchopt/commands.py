"""What `check` and `rewrite` do, and the language server's start, without the command-line parser:
`torchopt.cli` (typer) and the quick argument reader of `torchopt/__main__.py` both call these
functions, so that a command prints and exits the same way whichever read its arguments. Each
returns the exit code: 0 done or nothing to do; 1 changes pending (--diff/--check) or diagnostics
found (check); 2 a file could not be processed, bad usage or bad configuration."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, List, Optional

from torchopt import checking
from torchopt.rewrite import budget, interrupt, report, source
from torchopt.rewrite.config import ConfigError, Overrides, Resolver
from torchopt.rewrite.discovery import discover
from torchopt.rewrite.engine import Diagnostic
from torchopt.rewrite.place import pin
from torchopt.rewrite.runner import FileResult, Mode, process_text, run
from torchopt.rewrite.selection import SelectorError, expand_all, split_arg

EXIT_OK, EXIT_PENDING, EXIT_ERROR = 0, 1, 2


def _err(msg: str) -> None:
    sys.stderr.write(msg + "\n")


class _Usage(Exception):
    pass


DIST = "torchopt-rewrite"  # the distribution on PyPI: the name `torchopt` there is another project's


def _need_torch(what: str) -> None:
    """Running programs needs PyTorch, which the base install leaves out (linting never imports it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise _Usage(f"{what} runs your program and needs PyTorch: pip install '{DIST}[validate]'")


def _resolver(select, ignore, unsafe, config, extend_select=None) -> Resolver:
    try:
        sel = split_arg(select, "--select") or None
        ign = split_arg(ignore, "--ignore")
        ext = split_arg(extend_select, "--extend-select")
        expand_all(sel or ())
        expand_all(ign)
        expand_all(ext)
    except SelectorError as exc:
        raise _Usage(str(exc)) from None
    over = Overrides(
        select=tuple(sel) if sel else None, ignore=tuple(ign), unsafe_fixes=unsafe, extend_select=tuple(ext)
    )
    return Resolver(over, config)


def _check_format(fmt: str) -> None:
    if fmt not in report.FORMATS:
        raise _Usage(f"unknown --output-format {fmt!r} (choose from {', '.join(report.FORMATS)})")


def _progress(total: int):
    """A progress bar on a terminal for long runs; nothing when piped."""
    if total < 20 or not sys.stderr.isatty():
        return None, lambda n: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(
        TextColumn("torchopt"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = prog.add_task("files", total=total)
    return prog, lambda n: prog.advance(task, n)


def _open_cache(paths: list[str], resolver: Resolver, no_cache: bool, cache_dir: Optional[str]):
    """The result cache (see torchopt/rewrite/cache.py for where it lives); None with --no-cache or
    when it cannot be created, and with a warning when the folder is not torchopt's to use."""
    if no_cache:
        return None
    from torchopt.rewrite.cache import Cache, CacheRefused, default_dir

    settings = resolver.for_path(paths[0] if paths else ".")
    root = os.path.dirname(os.path.abspath(settings.config_path)) if settings.config_path else None
    try:
        return Cache.open(default_dir(root, cache_dir))
    except CacheRefused as exc:
        _err(f"warning: cache: {exc}; running without a cache")
        return None


def _run_files(
    paths: list[str],
    resolver: Resolver,
    mode: Mode,
    jobs: Optional[int],
    no_cache: bool = True,
    cache_dir: Optional[str] = None,
) -> list[FileResult]:
    files = discover(paths, resolver.for_path, on_skip=lambda path, why: _err(f"warning: {source.shown(path)}: {why}"))
    if not files:
        _err("warning: No Python files found under the given path(s)")
    places = pin(paths, files)
    cache = _open_cache(paths, resolver, no_cache, cache_dir) if files else None
    prog, advance = _progress(len(files))
    with prog or contextlib.nullcontext():
        results = run(files, resolver.for_path, mode, jobs, on_progress=advance, cache=cache, places=places)
    untrusted = sum(r.untrusted_cache for r in results)
    if cache is not None and untrusted:
        _err(
            f"warning: cache: {cache.root}: ignored {untrusted} {'entry' if untrusted == 1 else 'entries'} not written by "
            "your torchopt (copied, committed or altered); analysed again"
        )
    return results


def _read_stdin(name: str, data: bytes | None = None) -> FileResult | source.SourceText:
    """The decoded text, or the failed result that says why it cannot be decoded."""
    try:
        return source.decode(sys.stdin.buffer.read() if data is None else data)
    except source.SourceError as exc:
        return FileResult(path=name, status="failed", reason=str(exc))


def _print_failures(results: list[FileResult]) -> int:
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        _err(f"error: {source.shown(r.path)}: {r.reason}")
    return len(failed)


def _print_diff(text: str) -> None:
    if not sys.stdout.isatty():
        sys.stdout.write(text)
        return
    from rich.console import Console
    from rich.text import Text

    con = Console(highlight=False)
    for line in text.splitlines():
        style = (
            "bold"
            if line.startswith(("+++", "---"))
            else "green"
            if line.startswith("+")
            else "red"
            if line.startswith("-")
            else "cyan"
            if line.startswith("@@")
            else None
        )
        con.print(Text(line, style=style or ""))


def _unsafe_hint(hidden: list[Diagnostic]) -> str:
    tags = sorted({t for d in hidden if d.fix for t in d.fix.tags})
    what = f" (they change: {', '.join(tags)})" if tags else ""
    return (
        f"{report.plural(len(hidden), 'unsafe fix')} not applied ({report.per_code(hidden)}){what}; "
        "add --unsafe-fixes to apply them after reading `torchopt rule CODE`."
    )


# rewrite ---------------------------------------------------------------------------------------


def rewrite(
    paths: Optional[List[str]] = None,
    diff: bool = False,
    check: bool = False,
    unsafe_fixes: Optional[bool] = None,
    select: Optional[List[str]] = None,
    extend_select: Optional[List[str]] = None,
    ignore: Optional[List[str]] = None,
    jobs: Optional[int] = None,
    output_format: str = "text",
    stdin_filename: Optional[str] = None,
    config: Optional[str] = None,
    quiet: bool = False,
    validate: Optional[str] = None,
    steps: int = 20,
    timeout: float = 600.0,
    device: str = "auto",
    entry: Optional[str] = None,
    nproc: int = 1,
    script_arg: Optional[List[str]] = None,
    no_cache: bool = False,
    cache_dir: Optional[str] = None,
) -> int:
    """`torchopt rewrite`: apply fixes in place (safe ones by default) and print a summary."""
    # As an editor filter (`-` without --diff/--check), every error still gives the input back
    # unchanged on stdout: read it before anything can fail.
    stdin_data = sys.stdin.buffer.read() if paths == ["-"] else None
    echo = stdin_data if not (diff or check) else None
    try:
        _check_format(output_format)
        if diff and output_format != "text":
            raise _Usage("--diff prints a diff; --output-format applies to the report without --diff")
        resolver = _resolver(select, ignore, unsafe_fixes, config, extend_select)
        mode = Mode.DIFF if diff else Mode.LIST if check else Mode.FIX
        paths = paths or ["."]
        if paths == ["-"]:
            if validate:
                raise _Usage("--validate needs files, not stdin")
            return _rewrite_stdin(resolver, mode, stdin_filename or "-", output_format, quiet, stdin_data or b"")
        if validate:
            _need_torch("--validate")
            run_opts = dict(
                steps=steps,
                timeout=timeout,
                device=device,
                entry=entry,
                nproc=nproc,
                argv=tuple(script_arg or ()),
                jobs=jobs or os.cpu_count() or 1,
            )
            resolver = _validated_resolver(paths, resolver, validate, unsafe_fixes, run_opts)
            if resolver is None:
                return EXIT_PENDING
        results = _run_files(paths, resolver, mode, jobs, no_cache, cache_dir)
    except (ConfigError, _Usage) as exc:
        _give_back(echo)
        _err(f"error: {exc}")
        return EXIT_ERROR
    return _rewrite_report(results, mode, output_format, quiet)


def _validated_resolver(paths, resolver, entry, unsafe_fixes, run_opts):
    """Validate the rewrite by running ``entry``; leave out, file by file, the rules that broke it."""
    from torchopt.validate.gate import KeptResolver, check_rewrite

    if not os.path.isfile(entry):
        raise _Usage(f"--validate: {entry} is not a file")
    if run_opts["device"] not in ("auto", "cpu", "cuda"):
        raise _Usage("--device must be auto, cpu or cuda")
    files = discover(paths, resolver.for_path)
    unsafe = bool(unsafe_fixes) if unsafe_fixes is not None else resolver.for_path(entry).unsafe_fixes
    keep, lines = check_rewrite(files, resolver.for_path, entry, unsafe=unsafe, per_file=True, **run_opts)
    for line in lines:
        _err(line.rstrip("\n"))
    if keep is None:
        return resolver
    if not keep:
        _err("No fix kept the program equivalent; nothing written.")
        return None
    dropped: dict[str, set[str]] = {}
    for f in files:
        real = os.path.realpath(f)
        kept_here = {c for p, c in keep if p == real}
        dropped[real] = set(resolver.for_path(f).enabled_codes(f)) - kept_here
    return KeptResolver(resolver, dropped)


def _give_back(data: bytes | None) -> None:
    """An editor filter never swallows its input: on an error it prints it back, byte for byte."""
    if data is not None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def _rewrite_stdin(resolver: Resolver, mode: Mode, name: str, fmt: str, quiet: bool, data: bytes) -> int:
    echo = data if mode is Mode.FIX else None
    settings = resolver.for_path(name if name != "-" else os.path.join(os.getcwd(), "-"))
    src = _read_stdin(name, data)
    if isinstance(src, FileResult):
        _give_back(echo)
        return 2 if _print_failures([src]) else 0
    try:
        with budget.time_limit(budget.FILE_SECONDS):
            res = process_text(src.text, name, settings, mode)
        out = src.encode(res.new_text or "") if mode is Mode.FIX and res.status == "ok" and res.changed else data
    except interrupt.Interrupted:
        _give_back(echo)
        raise
    except budget.TimeBudgetExceeded as exc:
        res = FileResult(path=name, status="failed", reason=str(exc))
    except Exception as exc:  # a bug of ours, or a fix the declared encoding cannot hold
        res = FileResult(path=name, status="failed", reason=f"internal error: {type(exc).__name__}: {exc}")
    if res.status != "ok":
        _give_back(echo)
        _print_failures([res])
        return EXIT_ERROR
    if mode is Mode.FIX:
        _give_back(out)
        return _rewrite_report([res], mode, fmt, quiet, to_stdout=False)
    return _rewrite_report([res], mode, fmt, quiet)


def _rewrite_report(results: list[FileResult], mode: Mode, fmt: str, quiet: bool, to_stdout: bool = True) -> int:
    changed = [r for r in results if r.changed]
    applied = [d for r in results for d in r.applied]
    remaining = [d for r in results for d in r.remaining]
    hidden = [d for d in remaining if d.fix is not None and d.fix.safety == "unsafe"]
    unfixable = [d for d in remaining if d.fix is None]
    if to_stdout:
        if mode is Mode.DIFF:
            for r in changed:
                _print_diff(r.diff)
        elif fmt != "text":
            sys.stdout.write(report.render(remaining, fmt, fixed=applied))
        elif mode is Mode.LIST:
            for r in changed:
                print(f"Would rewrite: {source.shown(r.path)}")
    n_failed = _print_failures(results)
    if not quiet:
        for d in applied:
            if d.fix and d.fix.safety == "unsafe":
                _err(f"{report.location(d)}: {d.code} unsafe fix: {d.fix.title} — changes {d.fix.changes()}")
        verb = "Fixed" if mode is Mode.FIX else "Would fix"
        if applied:
            _err(
                f"{verb} {report.plural(len(applied), 'issue')} in {report.plural(len(changed), 'file')} "
                f"({report.per_code(applied)})."
            )
        else:
            _err("Nothing to fix." if not n_failed else "Nothing fixed.")
        if hidden:
            _err(_unsafe_hint(hidden))
        if unfixable:
            _err(
                f"{report.plural(len(unfixable), 'diagnostic')} without an automatic fix; "
                "run `torchopt check` to see them."
            )
        if n_failed:
            _err(f"{report.plural(n_failed, 'file')} could not be processed (left unchanged).")
    if n_failed:
        return EXIT_ERROR
    if mode in (Mode.DIFF, Mode.LIST) and changed:
        return EXIT_PENDING
    return EXIT_OK


# check -----------------------------------------------------------------------------------------


def check(
    paths: Optional[List[str]] = None,
    fix: bool = False,
    unsafe_fixes: Optional[bool] = None,
    show_fixes: bool = False,
    exit_zero: bool = False,
    statistics: bool = False,
    add_noqa: bool = False,
    select: Optional[List[str]] = None,
    extend_select: Optional[List[str]] = None,
    ignore: Optional[List[str]] = None,
    jobs: Optional[int] = None,
    output_format: str = "text",
    output_file: Optional[str] = None,
    stdin_filename: Optional[str] = None,
    config: Optional[str] = None,
    quiet: bool = False,
    no_cache: bool = False,
    cache_dir: Optional[str] = None,
    profile: Optional[str] = None,
) -> int:
    """`torchopt check`: report every diagnostic, fixable or not (with --fix: fix what can be, report
    the rest)."""
    try:
        _check_format(output_format)
        if fix and add_noqa:
            raise _Usage("--add-noqa cannot be combined with --fix")
        resolver = _resolver(select, ignore, unsafe_fixes, config, extend_select)
        mode = Mode.FIX if fix else Mode.CHECK
        paths = paths or ["."]
        if paths == ["-"]:
            if add_noqa:
                raise _Usage("--add-noqa needs files, not stdin")
            results = [_check_stdin(resolver, stdin_filename or "-", mode)]
        else:
            results = _run_files(paths, resolver, mode, jobs, no_cache, cache_dir)
    except (ConfigError, _Usage) as exc:
        _err(f"error: {exc}")
        return EXIT_ERROR
    if add_noqa:
        return checking.add_noqa(results, quiet)
    diags = [d for r in results for d in (r.remaining if fix else r.diagnostics)]
    if profile is not None:
        from torchopt.codemods.sync.profile_evidence import ProfileError, apply_profile

        try:
            diags = apply_profile(profile, diags)
        except ProfileError as exc:
            _err(f"error: {exc}")
            return EXIT_ERROR
    if statistics:
        out = report.statistics(diags, output_format)
    else:
        edits = checking.edits_of(results, diags, resolver.for_path) if output_format == "json" else None
        out = report.render(diags, output_format, edits=edits or (lambda d: None))
    try:
        checking.write_output(out, output_file)
    except OSError as exc:
        _err(f"error: --output-file {output_file}: {exc.strerror or exc}")
        return EXIT_ERROR
    n_failed = _print_failures(results)
    applied = [d for r in results for d in r.applied]
    if show_fixes and applied:
        _err(report.fixed_per_file(results))
    if not quiet and (output_format == "text" or output_file):
        _err(checking.summary(diags, applied, fix, n_failed))
    if n_failed:
        return EXIT_ERROR
    return EXIT_PENDING if diags and not exit_zero else EXIT_OK


def _check_stdin(resolver: Resolver, name: str, mode: Mode) -> FileResult:
    """`check -` reports on stdin; with --fix it also writes the fixed source to stdout (as ruff)."""
    data = sys.stdin.buffer.read()
    src = _read_stdin(name, data)
    if isinstance(src, FileResult):
        return src
    settings = resolver.for_path(name if name != "-" else os.path.join(os.getcwd(), "-"))
    res = process_text(src.text, name, settings, mode)
    if mode is Mode.FIX:
        fixed = res.status == "ok" and res.changed
        _give_back(src.encode(res.new_text or "") if fixed else data)
    return res


# lsp -------------------------------------------------------------------------------------------


def lsp() -> int:
    """`torchopt lsp`: run the language server on stdio (needs pygls 2: the `lsp` extra)."""
    try:
        from torchopt.lsp.server import main as serve
    except ImportError as exc:
        _err(f"error: `torchopt lsp` needs pygls 2: pip install '{DIST}[lsp]' ({exc})")
        return EXIT_ERROR
    serve()
    return EXIT_OK


def split_script_args(argv: list[str]) -> list[str]:
    """`torchopt validate a.py -- --lr 0.1` -> `... --script-arg=--lr --script-arg=0.1`; the same for
    `torchopt rewrite PATH --validate ENTRY.py -- ARGS` (without --validate, `--` ends the options
    of rewrite as usual and what follows are paths)."""
    if len(argv) < 2 or "--" not in argv:
        return argv
    i = argv.index("--")
    validating = any(a == "--validate" or a.startswith("--validate=") for a in argv[2:i])
    if argv[1] == "validate" or (argv[1] == "rewrite" and validating):
        return argv[:i] + [f"--script-arg={a}" for a in argv[i + 1 :]]
    return argv


def run_command(command: Callable[[], object], serving: bool = False) -> None:
    """Run ``command`` (it exits by raising SystemExit). Ctrl-C and SIGTERM stop a command cleanly
    (exit 130/143; a write under way finishes). The language server (``serving``) keeps Python's own
    Ctrl-C handling, which its event loop expects."""
    try:
        with contextlib.nullcontext() if serving else interrupt.handle_stop_signals(abandon=True):
            command()
    except interrupt.Interrupted as stop:
        written = "" if stop.written is None else f": {report.plural(stop.written, 'file')} written"
        _err(f"interrupted{written}")
        sys.exit(stop.exit_code)
