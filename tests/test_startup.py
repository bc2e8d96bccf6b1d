"""What a one-file command imports and reads before it answers (counted, never timed; the times are
in benchmarks/startup.py): the rule index stands for the rules until a rule is needed, a file whose
text no rule's declared substrings accept imports no rule module, `check`, `rewrite -` and `lsp`
start without typer or rich, and the quick argument reader gives what typer gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import libcst as cst
import pytest
from libcst._batched_visitor import BatchableCSTVisitor
from typer.testing import CliRunner

from torchopt import commands
from torchopt.__main__ import quick_args
from torchopt.cli import app
from torchopt.rewrite import fastvisit, registry
from torchopt.rewrite.rule import RuleContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CNN = os.path.join(ROOT, "fixtures", "cnn_train", "before.py")


# the rule index ----------------------------------------------------------------------------------


def test_the_rule_index_describes_the_rules_as_they_are():
    """Fails when a rule, its declarations or a file of torchopt/codemods changed since the index was
    written: run `python -m torchopt.rewrite.registry --write-index`."""
    rules = registry.collect()
    index = registry.load_index()
    assert index is not None, "the index is stale: python -m torchopt.rewrite.registry --write-index"
    assert index == {code: registry.RuleInfo.of(cls) for code, cls in rules.items()}
    lazy = registry.all_rules()
    assert isinstance(lazy, registry.Registry)
    assert list(lazy) == list(rules) and all(lazy[code] is rules[code] for code in rules)


def test_an_index_that_does_not_describe_the_files_is_not_trusted(monkeypatch):
    files = registry.package_files()
    monkeypatch.setattr(registry, "package_files", lambda root=None: {**files, "device/new_rule.py": 10})
    assert registry.load_index() is None
    monkeypatch.setattr(registry, "package_files", lambda root=None: {**files, "device/__init__.py": -1})
    assert registry.load_index() is None
    registry.all_rules.cache_clear()
    try:
        rules = registry.all_rules()
        assert isinstance(rules, dict) and set(rules) == set(registry.collect())  # every module imported
    finally:
        registry.all_rules.cache_clear()


def test_the_index_is_written_from_the_rules(tmp_path):
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "__pycache__").mkdir()
    (tmp_path / "fam" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / "fam" / "a.py").write_text("pass\n")
    (tmp_path / "_index.py").write_text("RULES = ()\n")
    assert registry.package_files(str(tmp_path)) == {"fam/a.py": 5}
    rules = {code: cls for code, cls in registry.collect().items() if code in ("TOP101", "TOP104")}
    ns: dict = {}
    exec(registry.index_text(rules, {"fam/a.py": 5}), ns)
    assert ns["FILES"] == {"fam/a.py": 5}
    assert [registry.RuleInfo(*row) for row in ns["RULES"]] == [registry.RuleInfo.of(r) for r in rules.values()]


def _imported_rule_modules(text: str) -> set[str]:
    """The rule modules a check of ``text`` imports, in a fresh interpreter."""
    code = textwrap.dedent(
        """
        import json, sys
        from torchopt.rewrite.config import Settings
        from torchopt.rewrite.engine import check_source
        check_source(sys.stdin.read(), Settings(), "x.py")
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("torchopt.codemods."))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_a_file_no_rule_could_match_imports_no_rule_module():
    # the unused-suppression rule reads every file (it is asked for by the engine itself)
    assert _imported_rule_modules("x = 1\ny = x + 1\n") <= {
        "torchopt.codemods._index",
        "torchopt.codemods.suppression",
        "torchopt.codemods.suppression.unused_suppression",
    }


def test_a_training_script_imports_only_the_rules_its_text_could_match():
    with open(CNN, encoding="utf-8") as fh:
        text = fh.read()
    from torchopt.rewrite.config import Settings

    rules = {code: rule for code, rule in registry.collect().items() if code in Settings().enabled_codes()}
    wanted = {r.__module__ for r in rules.values() if registry.RuleInfo.of(r).declared_match(text)}
    imported = _imported_rule_modules(text)
    assert wanted <= imported
    not_wanted = {r.__module__ for r in rules.values()} - wanted
    assert not_wanted and not (not_wanted & imported)


def test_rules_visitor_methods_are_libcsts():
    """Rule.get_visitors reads the rule's own classes instead of running inspect.getmembers: the same
    methods, for every rule."""
    module = cst.parse_module("x = 1\n")
    for code, rule in registry.collect().items():
        visitor = rule(RuleContext(module=module, options={o.name: o.default for o in rule.options}, device_names=()))
        assert visitor.get_visitors() == BatchableCSTVisitor.get_visitors(visitor), code


def test_straight_line_node_visits_are_read_from_bytecode_as_from_source():
    """fastvisit reads whether a node class visits its children without branching from the bytecode;
    the source says the same for every node class of the installed LibCST."""
    import inspect
    import re

    branch = re.compile(r"\b(?:if|for|while|try|match|and|or|with)\b")
    classes = [c for c in vars(cst).values() if isinstance(c, type) and issubclass(c, cst.CSTNode)]
    checked = 0
    for cls in classes:
        method = getattr(cls, "_visit_and_replace_children", None)
        if method is None or getattr(method, "__isabstractmethod__", False):
            continue
        body = inspect.getsource(method).split(":", 1)[1]
        body = body.split('"""')[-1] if body.count('"""') >= 2 else body
        assert fastvisit._uniform(cls) is (branch.search(body) is None), cls.__name__
        checked += 1
    assert checked > 100


# the quick argument reader -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["--version"],
        ["check", "--help"],
        ["check", "-h"],
        ["rules"],
        ["validate", "a.py"],
        ["lsp", "--help"],
        ["check", "x.py", "--"],
        ["check", "x.py", "--jobs", "0"],
        ["check", "x.py", "--jobs", "two"],
        ["check", "x.py", "-j2"],
        ["check", "x.py", "-qe"],
        ["check", "x.py", "--select"],
        ["check", "x.py", "--select", "-q"],
        ["check", "x.py", "--output-format", "json", "--output-format", "text"],
        ["check", "x.py", "--unsafe-fixes", "--no-unsafe-fixes"],
        ["check", "x.py", "--quiet=yes"],
        ["check", "x.py", "--no-cach"],
        ["check", "x.py", "--diff"],
        ["rewrite", "x.py", "--validate", "train.py"],
        ["rewrite", "-", "--steps", "3"],
    ],
)
def test_anything_but_the_plain_spellings_is_left_to_typer(argv):
    assert quick_args(argv) is None


def test_the_plain_spellings_are_read():
    assert quick_args(["lsp"]) == ("lsp", {})
    assert quick_args(["check", "a.py", "-q", "--select", "TOP1", "--select=TOP2", "-j", "3", "b.py"]) == (
        "check",
        {"quiet": True, "select": ["TOP1", "TOP2"], "jobs": 3, "paths": ["a.py", "b.py"]},
    )
    assert quick_args(["rewrite", "-", "--no-unsafe-fixes", "--stdin-filename", "m.py"]) == (
        "rewrite",
        {"unsafe_fixes": False, "stdin_filename": "m.py", "paths": ["-"]},
    )
    assert quick_args(["check"]) == ("check", {})


SAFE = "import torch\nx = torch.zeros(3).cuda()\n"
UNSAFE = "import torch\ny = torch.rand(3).cuda()\n"
CLEAN = 'import torch\nz = torch.zeros(3, device="cuda")\n'
SUPPRESSED = "import torch\nw = torch.zeros(3).cuda()  # noqa: TOP101\nv = 1  # noqa: TOP102\n"

CASES = [
    (["check", "safe.py", "--no-cache"], None),
    (["check", ".", "--no-cache", "-q"], None),
    (["check", "--no-cache"], None),
    (["check", ".", "--no-cache", "--statistics"], None),
    (["check", ".", "--no-cache", "--statistics", "--output-format", "json"], None),
    (["check", "unsafe.py", "--no-cache", "--output-format", "json"], None),
    (["check", ".", "--no-cache", "--output-format=sarif"], None),
    (["check", ".", "--no-cache", "--output-format", "github", "-e"], None),
    (["check", ".", "--no-cache", "--select", "TOP1", "--ignore", "TOP101"], None),
    (["check", ".", "--no-cache", "--extend-select", "TOP1", "--select=TOP2", "-j", "1"], None),
    (["check", ".", "--no-cache", "--select", "nonsense"], None),
    (["check", ".", "--no-cache", "--select", ""], None),
    (["check", ".", "--no-cache", "--output-format", "xml"], None),
    (["check", "safe.py", "--no-cache", "--fix", "--show-fixes"], None),
    (["check", "unsafe.py", "--no-cache", "--fix", "--unsafe-fixes"], None),
    (["check", ".", "--no-cache", "--add-noqa"], None),
    (["check", ".", "--no-cache", "--fix", "--add-noqa"], None),
    (["check", ".", "--no-cache", "-o", "out/report.txt"], None),
    (["check", "missing.py", "--no-cache"], None),
    (["check", ".", "--cache-dir", "cachedir"], None),
    (["check", ".", "--no-cache", "--config", "nowhere.toml"], None),
    (["check", "-", "--stdin-filename", "safe.py"], SAFE),
    (["check", "-", "--fix"], SAFE),
    (["check", "-"], b"\xff\xfe\x00bad"),
    (["check", "-", "--add-noqa"], SAFE),
    (["rewrite", "-"], SAFE),
    (["rewrite", "-", "--unsafe-fixes", "-q"], UNSAFE),
    (["rewrite", "-", "--diff"], SAFE),
    (["rewrite", "-", "--check"], CLEAN),
    (["rewrite", "-"], "def broken(:\n"),
    (["rewrite", "-", "--diff", "--output-format", "json"], SAFE),
    (["rewrite", "-", "--output-format", "json"], SAFE),
    (["rewrite", ".", "--no-cache", "--diff"], None),
    (["rewrite", ".", "--no-cache", "--check"], None),
    (["rewrite", ".", "--no-cache"], None),
    (["rewrite", ".", "--no-cache", "--unsafe-fixes"], None),
]


def _project(path):
    path.mkdir()
    for name, text in (("safe.py", SAFE), ("unsafe.py", UNSAFE), ("clean.py", CLEAN), ("sup.py", SUPPRESSED)):
        (path / name).write_text(text)
    return path


def _files(path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(path)
        if "cachedir" not in d
        for n in names
    }


@pytest.mark.parametrize("argv, stdin", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_the_quick_reader_prints_and_exits_as_typer(tmp_path, monkeypatch, argv, stdin):
    """Same stdout, stderr, exit code and files written, whichever reads the arguments."""
    quick = quick_args(argv)
    assert quick is not None
    command, kwargs = quick
    monkeypatch.delenv("TORCHOPT_CACHE_DIR", raising=False)
    runner = CliRunner()
    monkeypatch.chdir(_project(tmp_path / "typer"))
    by_typer = runner.invoke(app, argv, input=stdin, catch_exceptions=False)
    typer_files = _files(".")
    monkeypatch.chdir(_project(tmp_path / "quick"))
    with runner.isolation(input=stdin) as (out, err, _):
        code = getattr(commands, command)(**kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        quick_out, quick_err = out.getvalue(), err.getvalue()
    assert (code, quick_out, quick_err) == (by_typer.exit_code, by_typer.stdout_bytes, by_typer.stderr_bytes)
    assert _files(".") == typer_files


def _run(main: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    """A command run as `python -m torchopt` (quick reader) or through typer (`torchopt.cli.main`),
    printing the third-party command-line modules it imported."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write(repr(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'typer', 'rich', 'click'})) + '\\n'))\n"
        f"sys.argv = ['torchopt', *{args!r}]\n"
        f"from {main} import main\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHOPT_CACHE_DIR"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, env=env)


@pytest.mark.parametrize("args", [["check", "safe.py", "sup.py", "--no-cache"], ["check", "--select", "bad"]])
def test_the_command_runs_without_typer_and_says_what_typer_says(tmp_path, args):
    quick = _run("torchopt.__main__", args, _project(tmp_path / "quick"))
    typer = _run("torchopt.cli", args, _project(tmp_path / "typer"))
    assert quick.stderr.endswith(b"[]\n"), quick.stderr
    assert typer.stderr.endswith(b"['click', 'rich', 'typer']\n") or b"typer" in typer.stderr.splitlines()[-1]
    assert (quick.returncode, quick.stdout) == (typer.returncode, typer.stdout)
    assert quick.stderr.splitlines()[:-1] == typer.stderr.splitlines()[:-1]


def test_a_profiled_command_still_writes_its_profile(tmp_path):
    """A one-file command ends without Python's teardown (``__main__.leave``), but not under a profiler,
    which writes its data when the program returns."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.zeros(3).to('cuda')\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHOPT_CACHE_DIR"}
    profile = tmp_path / "run.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "torchopt", "check", str(script), "--no-cache"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, env=env)
    plain = subprocess.run(cmd[:1] + cmd[5:], cwd=tmp_path, capture_output=True, env=env)
    assert plain.returncode == 1 and b"TOP101" in plain.stdout  # (cProfile itself exits 0)
    assert (done.stdout, done.stderr) == (plain.stdout, plain.stderr)
    assert profile.stat().st_size > 0
