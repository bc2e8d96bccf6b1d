"""The command line's options, shared by its commands (and the long ones of `validate`), so that
each command's signature stays a list of names."""

from __future__ import annotations

import typer

PathsArg = typer.Argument(None, help="Files or folders (default: the current folder); `-` reads stdin.")
SelectOpt = typer.Option(
    None, "--select", help="Rule codes, prefixes (TOP1), family names or ALL; comma-separated or repeated."
)
ExtendSelectOpt = typer.Option(
    None, "--extend-select", help="Like --select, but added to the selection of the configuration or --select."
)
IgnoreOpt = typer.Option(None, "--ignore", help="Codes, prefixes or families to leave out.")
UnsafeOpt = typer.Option(
    None, "--unsafe-fixes/--no-unsafe-fixes", help="Also apply fixes that change numerics, RNG streams or semantics."
)
JobsOpt = typer.Option(None, "--jobs", "-j", min=1, help="Worker processes (default: CPU count).")
FormatOpt = typer.Option("text", "--output-format", help="text | json | sarif | github")
StdinNameOpt = typer.Option(None, "--stdin-filename", help="Path used for config and messages when reading stdin.")
ConfigOpt = typer.Option(None, "--config", help="Use this pyproject.toml instead of the nearest one.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Print diagnostics and diffs only, no summary.")
NoCacheOpt = typer.Option(False, "--no-cache", help="Analyse every file again; do not read or write the cache.")
CacheDirOpt = typer.Option(
    None,
    "--cache-dir",
    help="Cache folder (default: $TORCHOPT_CACHE_DIR, else .torchopt_cache next to the pyproject.toml, else ~/.cache/torchopt).",
)


# `torchopt validate` -----------------------------------------------------------------------------

ExpectOpt = typer.Option(
    None,
    "--expect",
    metavar="CLASS",
    help="The class of a hand-made change: numerics[=bf16|fp16|tf32], rng, tolerance or semantics (repeatable).",
)
RevOpt = typer.Option(
    None,
    "--rev",
    metavar="BASE[..HEAD]",
    help="Compare BEFORE (the entry script) at two commits of its repository (HEAD by default).",
)
OutputFormatOpt = typer.Option("text", "--output-format", help="text | json | github")
TransplantOpt = typer.Option(
    False,
    "--transplant",
    help="Start the rewritten run from the original's weights, zero-padded (automatic after padding fixes, TOP301/TOP302).",
)
BisectJobsOpt = typer.Option(
    None,
    "--jobs",
    "-j",
    min=1,
    help="Runs at once while bisecting a divergence to the fixes that cause it (default: CPU count).",
)
BenchOpt = typer.Option(
    False,
    "--bench",
    help="After the comparison, time both versions one at a time and report step times, memory and the speed-up.",
)
BenchRepeatsOpt = typer.Option(3, "--bench-repeats", min=1, help="With --bench: rounds of (before, after) runs.")
BenchWarmupOpt = typer.Option(
    2, "--bench-warmup", min=0, help="With --bench: optimizer steps not timed at the start of each run."
)
AllowUnvalidatedOpt = typer.Option(
    None,
    "--allow-unvalidated",
    metavar="CODE",
    help="Accept that fixes of this rule could not be validated (exit by the verdict instead of 4).",
)
