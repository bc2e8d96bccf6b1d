"""The language server's project index follows the documents open in the editor: an unsaved edit of
one module changes the diagnostics another file draws from it (here TOP501, which asks the index
whether the model class built in main.py has convolutions), only the edited module's summary is made
again, and a result that read an unchanged summary is kept."""

from __future__ import annotations

import collections
import random
import sys
from pathlib import Path

import pytest

from torchopt.lsp.lanes import check_text
from torchopt.lsp.render import Renderer
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source
from torchopt.rewrite.incremental import IncrementalChecker
from torchopt.rewrite.projectscope import LiveScope, ProjectScope, in_scope

MAIN = '''\
"""Train a small CNN; the model comes from models/net.py."""
import torch
import torch.nn.functional as F

from models import Net


def train(model, optimizer, steps, device):
    model.train()
    for step in range(steps):
        images = torch.randn(32, 3, 32, 32, device=device)
        labels = torch.randint(0, 10, (32,), device=device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()


def main():
    device = torch.device("cuda")
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, 100, device)


if __name__ == "__main__":
    main()
'''

NET = """\
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))
"""
# The same model without a convolution: nothing for the cuDNN auto-tuner to tune.
NET_NO_CONV = NET.replace("nn.Conv2d(3, 16, 3, padding=1)", "nn.Identity()").replace(
    "self.conv(x).mean(dim=(2, 3))", "self.conv(x).flatten(1)[:, :16]"
)


def _project(root: Path) -> dict[str, Path]:
    files = {"main": root / "main.py", "init": root / "models" / "__init__.py", "net": root / "models" / "net.py"}
    (root / "models").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n", encoding="utf-8")
    files["main"].write_text(MAIN, encoding="utf-8")
    files["init"].write_text("from .net import Net\n", encoding="utf-8")
    files["net"].write_text(NET, encoding="utf-8")
    return files


def _check(checker: IncrementalChecker, scope: LiveScope, path: Path, text: str) -> tuple[list, frozenset[str]]:
    problem, diags, _, reads = check_text(
        checker, text, Settings(), str(path), lambda: False, ("utf-16", ""), Renderer(), scope
    )
    assert problem is None
    return diags, reads


def _codes(diags) -> list[str]:
    return sorted({d.code for d in diags})


def _on_disk(root: Path, files: dict[str, str]) -> list[tuple[str, int, int, str]]:
    """A full check of main.py in a project folder holding ``files`` (what `torchopt check` says
    after they are saved), as (code, line, column, message)."""
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n", encoding="utf-8")
    with in_scope(ProjectScope(folders=[str(root)])):
        diags = check_source((root / "main.py").read_text(encoding="utf-8"), Settings(), str(root / "main.py"))
    return [(d.code, d.line, d.column, d.message) for d in diags.diagnostics]


def _plain(diags) -> list[tuple[str, int, int, str]]:
    return [(d.code, d.line, d.column, d.message) for d in diags]


def test_an_unsaved_edit_of_a_model_changes_what_the_training_script_is_told(tmp_path):
    files = _project(tmp_path / "p")
    scope, checker = LiveScope(), IncrementalChecker()
    scope.set_text(str(files["main"]), MAIN)
    scope.set_text(str(files["net"]), NET)
    before, reads = _check(checker, scope, files["main"], MAIN)
    assert "TOP501" in _codes(before)
    assert str(files["net"].resolve()) in reads  # the server re-checks main.py when net.py changes
    assert _plain(before) == _on_disk(
        tmp_path / "saved1", {"main.py": MAIN, "models/__init__.py": "from .net import Net\n", "models/net.py": NET}
    )
    built = collections.Counter(scope.built)

    assert scope.set_text(str(files["net"]), NET_NO_CONV)  # typed in the editor, not saved
    after, _ = _check(checker, scope, files["main"], MAIN)
    assert "TOP501" not in _codes(after)
    assert _plain(after) == _on_disk(
        tmp_path / "saved2",
        {"main.py": MAIN, "models/__init__.py": "from .net import Net\n", "models/net.py": NET_NO_CONV},
    )
    assert files["net"].read_text(encoding="utf-8") == NET  # nothing written
    # Only the edited module's summary was made again; models/__init__.py was not read again.
    assert scope.built - built == collections.Counter({str(files["net"].resolve()): 1})

    scope.set_text(str(files["net"]), None)  # closed without saving: the file's text counts again
    again, _ = _check(checker, scope, files["main"], MAIN)
    assert _plain(again) == _plain(before)


def test_an_edit_that_leaves_the_models_summary_alone_keeps_the_scripts_result(tmp_path):
    files = _project(tmp_path / "p")
    scope, checker = LiveScope(), IncrementalChecker()
    first, _ = _check(checker, scope, files["main"], MAIN)
    scope.set_text(str(files["net"]), NET.replace("dim=(2, 3)", "dim=(3, 2)"))  # forward() only
    second, _ = _check(checker, scope, files["main"], MAIN)
    assert second == first
    assert checker.last_misses == 0 and not checker.last_whole  # nothing analysed again
    scope.set_text(str(files["net"]), NET_NO_CONV)
    third, _ = _check(checker, scope, files["main"], MAIN)
    assert third != first and checker.last_misses + checker.last_whole > 0


def test_what_counts_as_a_change_of_the_text_other_files_see(tmp_path):
    files = _project(tmp_path / "p")
    scope = LiveScope()
    net = str(files["net"])
    assert not scope.set_text(net, NET)  # opened with its saved text: nothing to re-check
    assert scope.set_text(net, NET_NO_CONV)  # typed
    assert not scope.set_text(net, NET_NO_CONV)
    assert scope.set_text(net, None)  # closed without saving: the saved text counts again
    assert not scope.set_text(net, None)
    assert scope.text(net) == NET


def test_a_file_saved_outside_the_editor_is_read_again(tmp_path):
    files = _project(tmp_path / "p")
    scope, checker = LiveScope(), IncrementalChecker()
    first, _ = _check(checker, scope, files["main"], MAIN)
    assert "TOP501" in _codes(first)
    files["net"].write_text(NET_NO_CONV + "\n# saved by another program\n", encoding="utf-8")
    second, _ = _check(checker, scope, files["main"], MAIN)
    assert "TOP501" not in _codes(second)


# A 300-line script of its own: a model, helpers and training code in connected functions and
# independent blocks, edited at random; after each edit the server's check equals a full check.
_BLOCK = """

class Block{i}(nn.Module):
    def __init__(self, width={w}):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


def data_{i}(n=64):
    x = torch.randn(n, 3, 16, 16)
    y = torch.randint(0, 10, (n,))
    return DataLoader(TensorDataset(x, y), batch_size=8, num_workers=0)


def fit_{i}(steps=3):
    model = Block{i}().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(data_{i}()):
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(loss.item())
    return model
"""


def _script() -> str:
    text = (
        "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
    )
    i = 0
    while text.count("\n") < 270:
        text += _BLOCK.format(i=i, w=8 + 3 * i)
        i += 1
    calls = "".join(f"    fit_{k}()\n" for k in range(i))
    text += f"\n\ndef main():\n    torch.manual_seed(0)\n{calls}\n\nif __name__ == '__main__':\n    main()\n"
    return text


_TYPED = ["0.5", "17", "True", "x.item()", "torch.zeros(2).cuda()", "model.eval()", "len(x)"]


def _edit(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    line = lines[i]
    kind = rng.random()
    if kind < 0.5:  # a value typed over a number
        spots = [k for k, c in enumerate(line) if c.isdigit() and line[k - 1] in "=(, "]
        if spots:
            k = rng.choice(spots)
            j = k
            while j < len(line) and (line[j].isdigit() or line[j] == "."):
                j += 1
            lines[i] = line[:k] + rng.choice(_TYPED) + line[j:]
    elif kind < 0.7 and line.startswith("        "):  # a statement added to a body
        lines.insert(i, "        " + rng.choice(["print(x.sum().item())", "torch.cuda.synchronize()", "pass"]))
    elif kind < 0.85 and line.strip():  # a line removed
        del lines[i]
    else:  # main() stops calling a block, or calls it again
        lines = [
            ln.replace("    fit_", "    # fit_", 1) if ln.startswith("    fit_") and rng.random() < 0.3 else ln
            for ln in lines
        ]
    return "\n".join(lines)


def test_an_undo_finds_the_earlier_result_of_the_same_text(tmp_path):
    text = _script()
    path = tmp_path / "train.py"
    path.write_text(text, encoding="utf-8")
    scope, checker = LiveScope(), IncrementalChecker()
    first, _ = _check(checker, scope, path, text)
    edited = text.replace("lr=0.05", "lr=0.5", 1)
    second, _ = _check(checker, scope, path, edited)
    assert checker.last_whole  # main() reaches every block: the whole text was analysed again
    third, _ = _check(checker, scope, path, text)  # the edit undone
    assert third == first
    assert checker.last_misses == 0 and not checker.last_whole


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_random_edits_of_a_300_line_script_give_a_full_checks_diagnostics(tmp_path, seed):
    from torchopt.rewrite.engine import ParseError

    text = _script()
    assert 280 <= text.count("\n") <= 320
    path = tmp_path / "train.py"
    path.write_text(text, encoding="utf-8")
    scope, checker, rng, compared = LiveScope(), IncrementalChecker(), random.Random(seed), 0
    _check(checker, scope, path, text)
    for _ in range(12):
        new = _edit(text, rng)
        try:
            expected = check_source(new, Settings(), str(path)).diagnostics
        except ParseError:
            continue
        got, _ = _check(checker, scope, path, new)
        assert collections.Counter(got) == collections.Counter(expected), new
        assert got == expected
        text, compared = new, compared + 1
    assert compared >= 8


# The same over the protocol: two documents open, one edited (unsaved), the other's diagnostics follow.

pytest.importorskip("pytest_lsp")
from pytest_lsp import ClientServerConfig, LanguageClient  # noqa: E402
from test_lsp import _change, _init, _publish  # noqa: E402
import pytest_lsp  # noqa: E402
from lsprotocol import types as lsp  # noqa: E402


@pytest_lsp.fixture(config=ClientServerConfig(server_command=[sys.executable, "-m", "torchopt", "lsp"]))
async def project_client(lsp_client: LanguageClient, tmp_path):
    files = _project(tmp_path / "p")
    await _init(lsp_client, tmp_path / "p", "visual-studio-code", {"select": ["TOP5"], "debounceMs": 20})
    lsp_client.files = files  # type: ignore[attr-defined]
    yield
    await lsp_client.shutdown_session()


@pytest.mark.asyncio
async def test_the_server_rechecks_a_file_when_a_module_it_reads_is_edited(project_client: LanguageClient):
    c = project_client
    files = c.files  # type: ignore[attr-defined]
    uris = {k: files[k].as_uri() for k in ("main", "net")}
    for k, text in (("main", MAIN), ("net", NET)):
        c.versions[uris[k]] = 1  # type: ignore[attr-defined]
        waiting = _publish(c, uris[k])
        c.text_document_did_open(
            lsp.DidOpenTextDocumentParams(lsp.TextDocumentItem(uri=uris[k], language_id="python", version=1, text=text))
        )
        first = await waiting
        if k == "main":
            assert "TOP501" in {d.code for d in first.diagnostics}
    waiting = _publish(c, uris["main"])
    _change(c, uris["net"], NET_NO_CONV)
    assert "TOP501" not in {d.code for d in (await waiting).diagnostics}
    waiting = _publish(c, uris["main"])
    _change(c, uris["net"], NET)
    assert "TOP501" in {d.code for d in (await waiting).diagnostics}
    assert files["net"].read_text(encoding="utf-8") == NET
