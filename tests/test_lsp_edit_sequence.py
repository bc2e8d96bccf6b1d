"""The language server's answer to a sequence of edits, driven through its own handlers
(``did_open``, ``did_change``, the scheduled analysis), equals a cold ``check_source`` of the same
text at every step: whatever an edit reuses of the results before it (the incremental checker's
groups, the whole-text results, the project index), it must not show in the diagnostics.

The edits are the latency benchmark's (benchmarks/lsp_latency.py): a new value typed over a number in
a function body of the connected 276-line training script, each value never written before; and
edits that change what the analyses see (a line added to a loop, a call removed, then undone)."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
from pathlib import Path

import pytest
from lsprotocol import types as lsp

from torchopt.lsp.handlers import did_change, did_open
from torchopt.lsp.server import create_server
from torchopt.rewrite.engine import check_source

ROOT = Path(__file__).resolve().parent.parent


def _benchmark():
    spec = importlib.util.spec_from_file_location("lsp_latency", ROOT / "benchmarks" / "lsp_latency.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _change(uri: str, version: int, line: int, a: int, b: int, new: str) -> lsp.DidChangeTextDocumentParams:
    change = lsp.TextDocumentContentChangePartial(
        range=lsp.Range(lsp.Position(line, a), lsp.Position(line, b)), text=new
    )
    return lsp.DidChangeTextDocumentParams(
        text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=version), content_changes=[change]
    )


def _line_edit(text: str, needle: str, new_line: str | None) -> tuple[int, int, int, str]:
    """(line, start, end, new): replace the first line holding ``needle`` (its code, indentation
    kept) by ``new_line``, or blank it out when None."""
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if needle in line)
    indent = len(lines[i]) - len(lines[i].lstrip())
    return i, indent, len(lines[i]), "pass" if new_line is None else new_line


async def _diagnostics_after_each_edit(tmp_path: Path, edits: list[tuple[int, int, int, str]]):
    """Open the benchmark's script, apply ``edits`` one by one as the editor would; after each,
    (the text, what the server published for it, what a cold check of it gives)."""
    bench = _benchmark()
    server = create_server()
    published = []
    server.publish = lambda doc: published.append((doc.text, list(doc.diags)))  # type: ignore[method-assign]
    path = tmp_path / "train.py"
    text = bench.TRAINING_SCRIPT
    path.write_text(text)
    uri = path.as_uri()
    try:
        td = lsp.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)
        await did_open(server, lsp.DidOpenTextDocumentParams(text_document=td))
        doc = server.docs[uri]
        await doc.task
        out = []
        for version, edit in enumerate(edits, 1):
            if isinstance(edit[0], str):  # a named line edit, made on the current text
                edit = _line_edit(doc.text, edit[0], edit[1])
            text = bench.apply(text, *edit)
            doc.last_edit = float("-inf")  # after a pause: checked at once, as in the benchmark
            await did_change(server, _change(uri, version, *edit))
            await doc.task
            assert doc.text == text and doc.checked_text == text
            cold = check_source(text, server.settings_for(doc.path), doc.path).diagnostics
            out.append((text, published[-1][1], cold))
        return out
    finally:
        server.engine.shutdown(wait=True)


def _same(results) -> None:
    for text, got, cold in results:
        a, b = collections.Counter(cold), collections.Counter(got)
        assert a == b, (
            f"after an edit to:\n{text}\nonly cold: {list((a - b).elements())}\nonly server: {list((b - a).elements())}"
        )
        assert got == sorted(got, key=lambda d: d.sort_key())


@pytest.mark.slow
def test_the_benchmarks_number_edits_give_a_cold_checks_diagnostics(tmp_path):
    bench = _benchmark()
    text, edits = bench.TRAINING_SCRIPT, []
    for k in range(1, 13):
        edit = bench.number_edit(text, k)
        text = bench.apply(text, *edit)
        edits.append(edit)
    _same(asyncio.run(_diagnostics_after_each_edit(tmp_path, edits)))


def test_edits_that_change_findings_give_a_cold_checks_diagnostics(tmp_path):
    # A host read added to the training loop and removed again; `set_to_none=False` dropped; a
    # `zero_grad` call removed: each changes what whole-program analyses conclude.
    edits = [
        ("loss.backward()", "loss.backward(); print(loss.item())"),
        ("print(loss.item())", "loss.backward()"),
        ("optimizer.zero_grad(set_to_none=False)", "optimizer.zero_grad()"),
        ("model.zero_grad()", None),
    ]
    results = asyncio.run(_diagnostics_after_each_edit(tmp_path, edits))
    _same(results)
    counts = [len(cold) for _, _, cold in results]
    assert len(set(counts)) > 1, counts  # the edits did change the findings
