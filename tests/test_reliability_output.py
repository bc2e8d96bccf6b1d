"""Machine-readable reports on awkward file names and lines: SARIF locations that are valid URI
references and say how columns are counted, and GitHub workflow commands whose properties and
message cannot be cut short or misread. `torchopt check` never changes the files it reports on."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

import pytest
from typer.testing import CliRunner

from torchopt.cli import app
from torchopt.rewrite.engine import Diagnostic
from torchopt.rewrite.report import render

FINDING = "x = torch.zeros(3).cuda()"
SRC = f"import torch\n{FINDING}\n"
# A line with astral characters (two UTF-16 units each) before the finding.
EMOJI_LINE = f'label = "🔥🚀"; {FINDING}'
NAMES = [
    "my model #1 100%.py",
    "données/ünï 🔥.py",
    "C:\\win\\train,v2.py",  # a Windows-looking name: on POSIX, backslashes and a colon in one file name
    "odd,name::v2 50%.py",
]
# RFC 3986: unreserved, sub-delims, ':' '@' '/' and percent escapes; nothing else may appear.
URI_REFERENCE = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-F]{2})*")


def cli(*args):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def tree(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    for name in NAMES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(SRC, encoding="utf-8")
    (root / "emoji.py").write_text(f"import torch\n{EMOJI_LINE}\n", encoding="utf-8")
    (tmp_path / "outside.txt").write_text("untouched\n")
    monkeypatch.chdir(root)
    before = tree_digest(tmp_path)
    yield root
    assert tree_digest(tmp_path) == before, "reporting changed a file"


def locations(sarif: dict) -> dict[str, dict]:
    out = {}
    for result in sarif["runs"][0]["results"]:
        loc = result["locations"][0]["physicalLocation"]
        out[loc["artifactLocation"]["uri"]] = loc["region"]
    return out


def test_sarif_uris_are_percent_encoded_references_that_name_the_files(tree):
    r = cli("check", ".", "--output-format", "sarif", "--select", "TOP101")
    assert r.exit_code == 1, r.output
    uris = locations(json.loads(r.stdout))
    for uri in uris:
        assert URI_REFERENCE.fullmatch(uri), f"not a valid URI reference: {uri!r}"
        assert not urlsplit(uri).scheme and not urlsplit(uri).fragment and not urlsplit(uri).query
    assert sorted(unquote(u) for u in uris) == sorted(NAMES + ["emoji.py"])


def test_sarif_uri_of_an_absolute_path_is_a_file_uri(tree):
    r = cli("check", str(tree / "my model #1 100%.py"), "--output-format", "sarif")
    assert r.exit_code == 1, r.output
    (uri,) = locations(json.loads(r.stdout))
    assert uri.startswith("file:///") and URI_REFERENCE.fullmatch(uri[len("file:") :])
    assert url2pathname(urlsplit(uri).path) == str(tree / "my model #1 100%.py")


def test_sarif_declares_columns_in_code_points_on_a_line_with_emoji(tree):
    r = cli("check", "emoji.py", "--output-format", "sarif", "--select", "TOP101")
    sarif = json.loads(r.stdout)
    run = sarif["runs"][0]
    assert run["columnKind"] == "unicodeCodePoints"
    region = locations(sarif)["emoji.py"]
    start = EMOJI_LINE.index("torch.zeros") + 1
    assert (region["startLine"], region["startColumn"]) == (2, start)
    assert region["endColumn"] == len(EMOJI_LINE) + 1
    # In UTF-16 units (SARIF's default when undeclared) the same place is two columns further on.
    assert len(EMOJI_LINE[: start - 1].encode("utf-16-le")) // 2 + 1 == start + 2


def parse_workflow_command(line: str) -> tuple[str, dict[str, str], str]:
    """What GitHub's runner reads from ``::cmd k=v,k=v::message``."""

    def unescape(s: str, prop: bool) -> str:
        if prop:
            s = s.replace("%3A", ":").replace("%2C", ",")
        return s.replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")

    assert line.startswith("::") and "\n" not in line and "\r" not in line
    head, sep, message = line[2:].partition("::")
    assert sep
    command, _, props = head.partition(" ")
    fields = {}
    for part in props.split(","):
        key, eq, value = part.partition("=")
        assert eq, f"broken property {part!r} in {line!r}"
        fields[key] = unescape(value, prop=True)
    return command, fields, unescape(message, prop=False)


def test_github_annotations_escape_file_title_and_message(tree):
    r = cli("check", ".", "--output-format", "github", "--select", "TOP101")
    lines = r.stdout.splitlines()
    assert len(lines) == len(NAMES) + 1
    files = []
    for line in lines:
        command, fields, message = parse_workflow_command(line)
        assert command == "warning"
        assert set(fields) == {"title", "file", "line", "col", "endLine", "endColumn"}
        assert fields["title"] == "torchopt (TOP101)" and message.startswith("TOP101 ")
        files.append(fields["file"])
    assert sorted(files) == sorted(NAMES + ["emoji.py"])

    # Messages and paths with every character the runner treats specially, round-tripped.
    diag = Diagnostic(
        code="TOP101",
        name="factory-then-move",
        message="50% done\r\nnext: a,b::c",
        path="a,b:c%\nd.py",
        line=1,
        column=1,
        end_line=1,
        end_column=2,
    )
    (line,) = render([diag], "github").splitlines()
    _, fields, message = parse_workflow_command(line)
    assert fields["file"] == "a,b:c%\nd.py" and message == "TOP101 50% done\r\nnext: a,b::c"
