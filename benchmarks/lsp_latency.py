"""Language-server latency: time from `textDocument/didChange` to the `publishDiagnostics` for that
version, on a 2,000-line training module, over 50 edits (one at a time, like a user typing and
pausing). Prints p50 / p95 / max, and what the engine alone takes on the same text.

    python benchmarks/lsp_latency.py [--lines 2000] [--edits 50] [--debounce-ms 50] [--select TOP1]
                                     [--profile]

The latency includes the server's debounce (default 50 ms): the time an editor waits after the last
keystroke. The server checks incrementally (only the edited group of statements is analysed again,
rewrite/incremental.py); "check_source alone" is what a full check of the module costs.
`--profile` prints where check_source spends its time on this module.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

from lsprotocol import types as lsp
from pygls.lsp.client import LanguageClient

HEADER = '''"""A long training module (generated for the LSP latency benchmark)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
'''

BLOCK = '''

class Net{i}(nn.Module):
    """Model {i}: conv, norm, head."""

    def __init__(self, width={w}):
        super().__init__()
        self.conv = nn.Conv2d(3, width, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = x.mean(dim=(2, 3))
        return self.head(x)


def make_loader_{i}(n=64):
    images = torch.randn(n, 3, 16, 16)
    labels = torch.randint(0, 10, (n,))
    return DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True)


def train_{i}(steps=3):
    model = Net{i}().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mean = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1).to(device)
    scratch = torch.zeros(8, {w}).cuda()
    losses = []
    model.train()
    for step, (x, y) in enumerate(make_loader_{i}()):
        if step >= steps:
            break
        x = x.to(device)
        y = y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x - mean), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, scratch
'''


def training_module(lines: int) -> str:
    """Whole blocks up to ``lines`` lines, padded with plain statements to exactly ``lines``."""
    text, i = HEADER, 0
    while True:
        block = BLOCK.format(i=i, w=8 + i % 8)
        if text.count("\n") + block.count("\n") > lines:
            break
        text += block
        i += 1
    pad = lines - text.count("\n")
    return text + "".join(f"PAD_{k} = {k}\n" for k in range(pad))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux), to tell engine work from waiting on a busy machine."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def measure(text: str, edits: int, options: dict) -> tuple[list[float], int, float | None]:
    client = LanguageClient("lsp-latency", "1")
    published: dict[int | None, float] = {}
    event = asyncio.Event()
    counts: dict[int | None, int] = {}

    @client.feature(lsp.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diagnostics(params: lsp.PublishDiagnosticsParams) -> None:
        published[params.version] = time.perf_counter()
        counts[params.version] = len(params.diagnostics)
        event.set()

    @client.feature(lsp.WINDOW_LOG_MESSAGE)
    def on_log(params: lsp.LogMessageParams) -> None:
        print(f"  server: {params.message}", file=sys.stderr)

    @client.feature(lsp.CLIENT_REGISTER_CAPABILITY)
    def on_register(params: lsp.RegistrationParams) -> None:
        return None

    await client.start_io(sys.executable, "-m", "torchopt", "lsp")
    folder = tempfile.mkdtemp(prefix="torchopt-lsp-bench-")
    path = os.path.join(folder, "train_long.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    uri = "file://" + path
    await client.initialize_async(
        lsp.InitializeParams(
            capabilities=lsp.ClientCapabilities(), root_uri="file://" + folder, initialization_options=options
        )
    )
    client.initialized(lsp.InitializedParams())

    async def wait_for(version: int) -> float:
        while version not in published:
            event.clear()
            await asyncio.wait_for(event.wait(), 1800)
        return published[version]

    client.text_document_did_open(
        lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)
        )
    )
    await wait_for(0)
    lines = text.splitlines()
    targets = [i for i, line in enumerate(lines) if "lr=0.05" in line]
    latencies = []
    pid = client._server.pid if client._server is not None else -1  # type: ignore[attr-defined]
    cpu0 = cpu_seconds(pid)
    for k in range(1, edits + 1):
        line = targets[(k * 7) % len(targets)]
        col = lines[line].index("lr=0.05") + len("lr=0.0")
        change = lsp.TextDocumentContentChangePartial(
            range=lsp.Range(lsp.Position(line, col), lsp.Position(line, col + 1)), text=str(k % 10)
        )
        t0 = time.perf_counter()
        client.text_document_did_change(
            lsp.DidChangeTextDocumentParams(
                text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=k), content_changes=[change]
            )
        )
        latencies.append(await wait_for(k) - t0)
        print(f"  edit {k}: {latencies[-1] * 1000:.0f} ms", file=sys.stderr, flush=True)
    n = counts[edits]
    cpu1 = cpu_seconds(pid)
    cpu = (cpu1 - cpu0) / edits if cpu0 is not None and cpu1 is not None else None
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return latencies, n, cpu


def engine_alone(text: str, options: dict, profile: bool, runs: int = 5) -> float:
    from torchopt.rewrite.config import Overrides, Settings
    from torchopt.rewrite.engine import check_source

    settings = Overrides(select=tuple(options["select"]) if "select" in options else None).apply(Settings())
    check_source(text, settings, "train_long.py")  # warm: rule imports, caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        check_source(text, settings, "train_long.py")
        times.append(time.perf_counter() - t0)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        check_source(text, settings, "train_long.py")
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--edits", type=int, default=50)
    ap.add_argument("--debounce-ms", type=float, default=50)
    ap.add_argument("--select", default=None, help="rule selectors, comma-separated (default: all rules)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-runs", type=int, default=5, help="in-process check_source runs to compare (0: skip)")
    args = ap.parse_args()
    text = training_module(args.lines)
    options: dict = {"debounceMs": args.debounce_ms}
    if args.select:
        options["select"] = args.select.split(",")
    latencies, n, cpu = asyncio.run(measure(text, args.edits, options))
    ms = [x * 1000 for x in latencies]
    alone = engine_alone(text, options, args.profile, args.engine_runs) * 1000 if args.engine_runs else None
    print(f"module: {args.lines} lines, {n} diagnostics; {args.edits} edits; debounce {args.debounce_ms:.0f} ms")
    print(
        f"didChange -> publishDiagnostics: p50 {percentile(ms, 0.5):.0f} ms, p95 {percentile(ms, 0.95):.0f} ms, "
        f"max {max(ms):.0f} ms"
    )
    if cpu is not None:
        print(f"server CPU time per edit: {cpu * 1000:.0f} ms (on a busy machine, wall time exceeds it)")
    if alone is not None:
        print(f"check_source alone (median of {args.engine_runs}, in-process): {alone:.0f} ms")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
