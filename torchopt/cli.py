"""The command line. Thin: arguments -> settings -> engine -> report. Exit codes: 0 done or nothing
to do; 1 changes pending (--diff/--check) or diagnostics found (check); 2 a file could not be
processed, bad usage or bad configuration (every other file is still processed)."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from torchopt import __version__, commands
from torchopt.commands import EXIT_ERROR, _err, _need_torch, _resolver, _Usage, split_script_args
from torchopt.options import (
    AllowUnvalidatedOpt,
    BenchOpt,
    BenchRepeatsOpt,
    BenchWarmupOpt,
    BisectJobsOpt,
    CacheDirOpt,
    ConfigOpt,
    ExpectOpt,
    ExtendSelectOpt,
    FormatOpt,
    IgnoreOpt,
    JobsOpt,
    NoCacheOpt,
    OutputFormatOpt,
    PathsArg,
    QuietOpt,
    RevOpt,
    SelectOpt,
    StdinNameOpt,
    TransplantOpt,
    UnsafeOpt,
)
from torchopt.rewrite import source
from torchopt.rewrite.config import ConfigError
from torchopt.rewrite.engine import FixError, ParseError
from torchopt.rewrite.registry import all_rules, source_path

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Rewrite PyTorch code into its fast form (PyTorch Performance Tuning Guide), safely.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"torchopt {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


# rewrite ---------------------------------------------------------------------------------------


@app.command()
def rewrite(
    paths: Optional[List[str]] = PathsArg,
    diff: bool = typer.Option(
        False, "--diff", help="Print a unified diff; write nothing. Exit 1 if anything would change."
    ),
    check: bool = typer.Option(False, "--check", help="List files that would change; write nothing. Exit 1 if any."),
    unsafe_fixes: Optional[bool] = UnsafeOpt,
    select: Optional[List[str]] = SelectOpt,
    extend_select: Optional[List[str]] = ExtendSelectOpt,
    ignore: Optional[List[str]] = IgnoreOpt,
    jobs: Optional[int] = JobsOpt,
    output_format: str = FormatOpt,
    stdin_filename: Optional[str] = StdinNameOpt,
    config: Optional[str] = ConfigOpt,
    quiet: bool = QuietOpt,
    validate: Optional[str] = typer.Option(
        None,
        "--validate",
        metavar="ENTRY.py",
        help="Run ENTRY.py before and after (rewritten files served from memory) and write only fixes that keep it computing the same thing.",
    ),
    steps: int = typer.Option(20, "--steps", min=1, help="With --validate: optimizer steps to run."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="With --validate: seconds each run may take."),
    device: str = typer.Option("auto", "--device", help="With --validate: auto | cpu | cuda"),
    entry: Optional[str] = typer.Option(
        None, "--entry", metavar="MODULE:FUNC", help="With --validate: call this function and compare what it returns."
    ),
    nproc: int = typer.Option(
        1, "--nproc", min=1, help="With --validate: run each version under torchrun with this many processes."
    ),
    script_arg: Optional[List[str]] = typer.Option(
        None, "--script-arg", help="With --validate: an argument for ENTRY.py (also: after `--`)."
    ),
    no_cache: bool = NoCacheOpt,
    cache_dir: Optional[str] = CacheDirOpt,
) -> None:
    """Apply fixes in place (safe ones by default) and print a summary."""
    raise typer.Exit(commands.rewrite(**locals()))


# check -----------------------------------------------------------------------------------------


@app.command("check")
def check_cmd(
    paths: Optional[List[str]] = PathsArg,
    fix: bool = typer.Option(
        False, "--fix", help="Apply safe fixes in place (as `torchopt rewrite`), then report what is left."
    ),
    unsafe_fixes: Optional[bool] = typer.Option(
        None,
        "--unsafe-fixes/--no-unsafe-fixes",
        help="With --fix: also apply fixes that change numerics, RNG streams or semantics (without --fix, "
        "check writes nothing).",
    ),
    show_fixes: bool = typer.Option(
        False, "--show-fixes", help="With --fix: list the fixes applied, per file and code."
    ),
    exit_zero: bool = typer.Option(
        False, "--exit-zero", "-e", help="Exit 0 even when diagnostics are found (2 still means an error)."
    ),
    statistics: bool = typer.Option(
        False, "--statistics", help="Print the number of diagnostics per code instead of each one."
    ),
    add_noqa: bool = typer.Option(
        False,
        "--add-noqa",
        help="Add `# noqa: CODE` to every line with a diagnostic (merged into a `# noqa:` list already there; comments are kept).",
    ),
    select: Optional[List[str]] = SelectOpt,
    extend_select: Optional[List[str]] = ExtendSelectOpt,
    ignore: Optional[List[str]] = IgnoreOpt,
    jobs: Optional[int] = JobsOpt,
    output_format: str = FormatOpt,
    output_file: Optional[str] = typer.Option(
        None, "--output-file", "-o", help="Write the diagnostics (or --statistics) to this file instead of stdout."
    ),
    stdin_filename: Optional[str] = StdinNameOpt,
    config: Optional[str] = ConfigOpt,
    quiet: bool = QuietOpt,
    no_cache: bool = NoCacheOpt,
    cache_dir: Optional[str] = CacheDirOpt,
    profile: Optional[str] = typer.Option(
        None,
        "--profile",
        help="A torch.profiler Chrome trace (recorded with with_stack=True): attach the "
        "synchronisations it recorded to the SYNC diagnostics of the functions that ran them.",
    ),
) -> None:
    """Report every diagnostic, fixable or not (with --fix: fix what can be, report the rest).
    Exit 1 when any is left, 0 when none, 2 when a file could not be checked."""
    raise typer.Exit(commands.check(**locals()))


# lsp -------------------------------------------------------------------------------------------


@app.command("lsp")
def lsp_cmd() -> None:
    """Run the language server on stdio (needs pygls 2: the `lsp` extra); see docs/editors.md."""
    raise typer.Exit(commands.lsp())


# rules / rule ----------------------------------------------------------------------------------


@app.command("rules")
def rules_cmd(output_format: str = typer.Option("text", "--output-format", help="text | json")) -> None:
    """List every rule."""
    rules = all_rules()
    if output_format == "json":
        import json

        rows = [
            {
                "code": c,
                "name": r.name,
                "family": r.family,
                "fix": r.safety.value,
                "file": source_path(r),
                "summary": r.summary(),
            }
            for c, r in rules.items()
        ]
        print(json.dumps(rows, indent=2))
        return
    width = max((len(r.name) for r in rules.values()), default=4)
    file_width = max((len(source_path(r)) for r in rules.values()), default=4)
    for code, r in rules.items():
        print(f"{code}  {r.name:<{width}}  {r.safety.value:<12}  {source_path(r):<{file_width}}  {r.summary()}")


@app.command("rule")
def rule_cmd(code: str = typer.Argument(..., help="A rule code such as TOP101, or a rule name.")) -> None:
    """Print a rule's page: what it does, why it is slow, examples, fix safety."""
    from torchopt.rewrite.ruledoc import render

    rules = all_rules()
    key = code.upper()
    rule = rules.get(key) or next((r for r in rules.values() if r.name == code), None)
    if rule is None:
        _err(f"error: unknown rule {code!r}; `torchopt rules` lists them")
        raise typer.Exit(EXIT_ERROR)
    sys.stdout.write(render(rule))


@app.command("validate")
def validate_cmd(
    before: str = typer.Argument(..., help="The program (a script, or the module an --entry imports)."),
    after: Optional[str] = typer.Argument(
        None, help="Its rewritten version; default: the rewrite torchopt would make, in memory."
    ),
    steps: int = typer.Option(20, "--steps", min=1, help="Stop each run after this many optimizer steps."),
    entry: Optional[str] = typer.Option(
        None, "--entry", metavar="MODULE:FUNC", help="Call this function in both versions and compare what it returns."
    ),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    select: Optional[List[str]] = SelectOpt,
    ignore: Optional[List[str]] = IgnoreOpt,
    unsafe_fixes: Optional[bool] = UnsafeOpt,
    nproc: int = typer.Option(1, "--nproc", min=1, help="Run each version under torchrun with this many processes."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds each run may take."),
    json_out: bool = typer.Option(False, "--json", help="Same as --output-format json."),
    script_arg: Optional[List[str]] = typer.Option(
        None, "--script-arg", help="An argument for the script (also: after `--`)."
    ),
    config: Optional[str] = ConfigOpt,
    transplant: bool = TransplantOpt,
    jobs: Optional[int] = BisectJobsOpt,
    bench: bool = BenchOpt,
    bench_repeats: int = BenchRepeatsOpt,
    bench_warmup: int = BenchWarmupOpt,
    expect: Optional[List[str]] = ExpectOpt,
    rev: Optional[str] = RevOpt,
    output_format: str = OutputFormatOpt,
    allow_unvalidated: Optional[List[str]] = AllowUnvalidatedOpt,
) -> None:
    """Run a program before and after its rewrite under the same seeds and compare what they compute.
    Exit 0 equivalent, 1 diverged, 2 could not run, 3 inconclusive, 4 fixes not validated."""
    from torchopt.validate.declared import parse as parse_expect

    if device not in ("auto", "cpu", "cuda"):
        _err("error: --device must be auto, cpu or cuda")
        raise typer.Exit(EXIT_ERROR)
    if output_format not in ("text", "json", "github"):
        _err(f"error: unknown --output-format {output_format!r} (choose from text, json, github)")
        raise typer.Exit(EXIT_ERROR)
    output_format = "json" if json_out else output_format
    if rev is not None:
        _validate_rev(rev, before, after, expect, output_format, steps, device, script_arg, timeout, nproc)
    try:
        _need_torch("`torchopt validate`")
        resolver = _resolver(select, ignore, unsafe_fixes, config)
        settings = resolver.for_path(before)
        from torchopt.validate.bench import BenchOptions
        from torchopt.validate.command import validate

        _check_device(device)

        try:
            declared = parse_expect(expect or ())
        except ValueError as exc:
            raise _Usage(str(exc)) from None
        out = validate(
            before,
            after,
            settings,
            unsafe=settings.unsafe_fixes,
            steps=steps,
            device=device,
            argv=tuple(script_arg or ()),
            entry=entry,
            nproc=nproc,
            timeout=timeout,
            transplant=transplant,
            jobs=jobs or os.cpu_count() or 1,
            bench=BenchOptions(bench_repeats, bench_warmup) if bench else None,
            expect=declared,
            allow_unvalidated=[c for arg in allow_unvalidated or () for c in arg.replace(",", " ").split()],
        )
    except (ConfigError, _Usage) as exc:
        _err(f"error: {exc}")
        raise typer.Exit(EXIT_ERROR)
    except (source.SourceError, OSError, ParseError, FixError) as exc:
        _err(f"error: {before}: {exc}")
        raise typer.Exit(EXIT_ERROR)
    from torchopt.validate.revisions import render

    sys.stdout.write(render(out, None, output_format))
    raise typer.Exit(out.exit_code)


def _check_device(device: str) -> None:
    """--device cuda on a machine without one is a usage error, said before anything runs."""
    from torchopt.validate.command import resolve_device

    if resolve_device(device) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise _Usage("--device cuda: no CUDA device is available here (use --device cpu or auto)")


def _validate_rev(rev, entry, after, expect, output_format, steps, device, script_arg, timeout, nproc) -> None:
    """`torchopt validate ENTRY.py --rev BASE[..HEAD]`; always exits."""
    from torchopt.validate.revisions import run_cli

    if after is not None:
        _err("error: --rev compares one entry script at two commits; give only ENTRY.py")
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(
        run_cli(rev, entry, expect or (), output_format, steps, device, tuple(script_arg or ()), timeout, nproc)
    )


@app.command("migrate")
def migrate_cmd(
    repos: Optional[List[str]] = typer.Argument(None, help="Git repositories (their top folders)."),
    repos_file: Optional[str] = typer.Option(
        None,
        "--repos-file",
        metavar="FILE",
        help="More repositories, one per line (# comments; relative to FILE's folder).",
    ),
    out: str = typer.Option(
        "torchopt-migrate", "--out", help="Folder for patches, report.md, report.json and the --resume state."
    ),
    branch: str = typer.Option(
        "torchopt/migrate", "--branch", help="With --commit: the branch to create in each repository."
    ),
    commit: bool = typer.Option(
        False,
        "--commit",
        help="Commit the rewrite on a new branch (built from git objects; your checkout is not touched).",
    ),
    validate: Optional[str] = typer.Option(
        None,
        "--validate",
        metavar="ENTRY",
        help="Run ENTRY (relative to each repository) before and after; keep only fixes that pass.",
    ),
    steps: int = typer.Option(20, "--steps", min=1, help="With --validate: optimizer steps to run."),
    select: Optional[List[str]] = SelectOpt,
    ignore: Optional[List[str]] = IgnoreOpt,
    unsafe_fixes: Optional[bool] = UnsafeOpt,
    jobs: Optional[int] = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Repositories migrated at once (default: CPU count); a single repository's files share them.",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Skip repositories an earlier run with the same options finished."
    ),
    allow_dirty: bool = typer.Option(False, "--allow-dirty", help="Migrate repositories with uncommitted changes too."),
    executor: str = typer.Option("local", "--executor", help="local | ray"),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="With --executor ray: the cluster (auto, ray://HOST:10001); default: a local Ray."
    ),
    quiet: bool = QuietOpt,
) -> None:
    """Migrate many git repositories: a patch per repository (or a commit on a branch) and a report.
    Exit 0 nothing to change or all committed, 1 patches written, 2 a repository or file failed."""
    from torchopt.migrate.command import run_command

    if validate:
        try:
            _need_torch("--validate")
        except _Usage as exc:
            _err(f"error: {exc}")
            raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(
        run_command(
            repos or [],
            repos_file,
            out,
            branch,
            commit,
            validate,
            steps,
            select,
            ignore,
            unsafe_fixes,
            jobs,
            resume,
            allow_dirty,
            executor,
            ray_address,
            quiet,
        )
    )


def main() -> None:
    """The `torchopt` command through typer (every command and option; see torchopt/__main__.py)."""
    from torchopt.rewrite import speedups

    speedups.install()  # this process's LibCST only: importing torchopt changes nothing
    sys.argv = split_script_args(sys.argv)
    commands.run_command(lambda: app(prog_name="torchopt"), serving=sys.argv[1:2] == ["lsp"])


if __name__ == "__main__":  # pragma: no cover
    main()
