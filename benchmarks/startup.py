"""Start-up of one-file commands beside the floor of any LibCST tool, measured in one run.

    python benchmarks/startup.py [FILE] [--rounds N] [--goal 1.5] [--instructions]

The floor is `python -c "import libcst; libcst.parse_module(open(FILE).read())"`: start Python,
import LibCST, parse the file once. Against it, one file each:

* `torchopt check FILE --no-cache` (a pre-commit hook run per file);
* `torchopt check - --stdin-filename FILE` and `torchopt rewrite - --stdin-filename FILE` (an
  editor's formatter-style filter, the file on stdin);
* `torchopt lsp` until it answers `initialize` (an editor starting the language server).

The commands run interleaved, round after round (floor, check, stdin check, stdin rewrite, lsp,
floor, ...), so that load on a shared machine weighs on all of them alike; the table gives the
median wall seconds and the median CPU seconds (user + system of the process) of each, and each
one's ratio to the floor's median next to the goal. With `--instructions` (needs valgrind), each
command except `lsp` also runs once under callgrind, and a second table gives the instructions it
executed and their ratio to the floor's: a count that other load on the machine does not change. The default FILE is a 86-line training script
(fixtures/cnn_train/before.py). Python's bytecode cache is allowed for the commands
(PYTHONDONTWRITEBYTECODE is unset) and every command runs once before the rounds, as an installed
package runs from compiled bytecode.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILE = os.path.join(ROOT, "fixtures", "cnn_train", "before.py")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(cmd: list[str], env: dict[str, str], stdin: bytes | None, cwd: str | None = None) -> tuple[float, float, int]:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, input=stdin or b"", capture_output=True, env=env, cwd=cwd)
    return time.perf_counter() - t0, _children_cpu() - cpu0, out.returncode


def _instructions(cmd: list[str], env: dict[str, str], stdin: bytes | None, cwd: str | None = None) -> int:
    """Instructions ``cmd`` executes (valgrind's callgrind counts them; other load does not change it)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
        input=stdin or b"",
        capture_output=True,
        env=env,
        cwd=cwd,
    )
    if b"took longer than" in out.stderr:  # the file's time budget rang under valgrind: a count of less work
        raise SystemExit(f"{cmd} ran out of its time budget under valgrind (a busy machine?): run it again")
    found = re.search(rb"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"valgrind gave no count for {cmd}: {out.stderr[-500:].decode(errors='replace')}")
    return int(found.group(1))


def _frame(payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _lsp_start(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Start the server, send `initialize`, stop the clock at its answer, then shut it down."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    init = {"processId": os.getpid(), "rootUri": None, "capabilities": {}}
    proc.stdin.write(_frame({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}))
    proc.stdin.flush()
    length = 0
    while True:  # the headers of the first message (the answer; the server sends nothing before it)
        line = proc.stdout.readline()
        if not line:
            break
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
        if line in (b"\r\n", b"\n"):
            break
    proc.stdout.read(length)
    wall = time.perf_counter() - t0
    for msg in ({"jsonrpc": "2.0", "id": 2, "method": "shutdown"}, {"jsonrpc": "2.0", "method": "exit"}):
        proc.stdin.write(_frame(msg))
    proc.stdin.close()
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return wall, _children_cpu() - cpu0, code if length else -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", default=DEFAULT_FILE)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--goal", type=float, default=1.5, help="the goal, as a multiple of the floor")
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="also count each command's instructions under valgrind (callgrind), once each",
    )
    ap.add_argument("--skip", action="append", default=[], choices=["check", "stdin-check", "stdin-rewrite", "lsp"])
    ap.add_argument(
        "--before",
        metavar="DIR",
        help="also time `check FILE --no-cache` of the torchopt package in DIR (another checkout), in the same rounds",
    )
    args = ap.parse_args()
    path = os.path.abspath(args.file)
    with open(path, "rb") as fh:
        data = fh.read()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("TORCHOPT_CACHE_DIR", None)
    py = sys.executable
    torchopt = [py, "-m", "torchopt"]
    floor = [py, "-c", "import libcst, sys; libcst.parse_module(open(sys.argv[1], encoding='utf-8').read())", path]
    runs = {
        "floor: import libcst + parse": lambda: _run(floor, env, None),
        "check": lambda: _run([*torchopt, "check", path, "--no-cache"], env, None),
        "stdin-check": lambda: _run([*torchopt, "check", "-", "--stdin-filename", path], env, data),
        "stdin-rewrite": lambda: _run([*torchopt, "rewrite", "-", "--stdin-filename", path], env, data),
        "lsp": lambda: _lsp_start([*torchopt, "lsp"], env),
    }
    labels = {
        "check": "torchopt check FILE --no-cache",
        "stdin-check": "torchopt check - (stdin)",
        "stdin-rewrite": "torchopt rewrite - (stdin)",
        "lsp": "torchopt lsp (until initialize answers)",
    }
    # each command as (argv, env, stdin), for the instruction counts (the language server aside)
    plain = {
        "floor: import libcst + parse": (floor, env, None),
        "check": ([*torchopt, "check", path, "--no-cache"], env, None),
        "stdin-check": ([*torchopt, "check", "-", "--stdin-filename", path], env, data),
        "stdin-rewrite": ([*torchopt, "rewrite", "-", "--stdin-filename", path], env, data),
    }
    runs = {k: v for k, v in runs.items() if k not in args.skip}
    if args.before:
        # run in that folder: `python -m` puts the current folder first on the path, ahead of PYTHONPATH
        old = dict(env, PYTHONPATH=os.path.abspath(args.before))
        plain["before"] = ([*torchopt, "check", path, "--no-cache"], old, None, args.before)
        runs["before"] = lambda: _run([*torchopt, "check", path, "--no-cache"], old, None, args.before)
        labels["before"] = f"check FILE --no-cache, {os.path.basename(os.path.abspath(args.before))}"
    lines = data.count(b"\n")
    print(f"file: {os.path.relpath(path)} ({lines} lines); {args.rounds} rounds, interleaved", file=sys.stderr)
    codes = {name: run()[2] for name, run in runs.items()}  # warm-up: bytecode written, files in the page cache
    walls: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            wall, cpu, _code = run()
            walls[name].append(wall)
            cpus[name].append(cpu)
    base = statistics.median(next(iter(walls.values())))
    base_cpu = statistics.median(next(iter(cpus.values())))
    head = f"{'what':<42} {'wall s':>7} {'CPU s':>7} {'x floor':>8} {'goal':>6}  exit"
    print(head)
    for name in runs:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        label = labels.get(name, name)
        ratio = "" if name not in labels else f"{wall / base:.2f}x"
        goal = "" if name not in labels else f"{args.goal:.1f}x"
        print(f"{label:<42} {wall:>7.3f} {cpu:>7.3f} {ratio:>8} {goal:>6}  {codes[name]}")
    print(
        "(CPU ratios: "
        + ", ".join(f"{n} {statistics.median(cpus[n]) / base_cpu:.2f}x" for n in labels if n in runs)
        + ")"
    )
    if args.instructions:
        counts = {name: _instructions(*plain[name]) for name in runs if name in plain}
        floor_count = next(iter(counts.values()))
        print(f"\n{'what':<42} {'instructions':>15} {'x floor':>8} {'goal':>6}")
        for name, count in counts.items():
            label = labels.get(name, name)
            ratio = "" if name not in labels else f"{count / floor_count:.2f}x"
            goal = "" if name not in labels else f"{args.goal:.1f}x"
            print(f"{label:<42} {count:>15,} {ratio:>8} {goal:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
