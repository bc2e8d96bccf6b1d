"""Generated rule pages are committed and current; README's set-up commands are the ones CI runs."""
import os
import re

from torchopt.rewrite.ruledoc import pages

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_rule_pages_are_current():
    folder = os.path.join(ROOT, "docs", "rules")
    want = pages()
    have = {n for n in os.listdir(folder) if n.endswith(".md")}
    assert have == set(want), "run: python -m torchopt.rewrite.ruledoc docs/rules"
    for name, text in want.items():
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            assert fh.read() == text, f"docs/rules/{name} is stale: python -m torchopt.rewrite.ruledoc docs/rules"


def test_readme_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    cmd = next(l for l in ci.splitlines() if "pytest" in l and "pip install" in l)
    assert cmd.strip() in readme


def test_readme_main_command_names_a_bundled_fixture():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"torchopt rewrite (fixtures/\S+) --diff", readme)
    assert m and os.path.isfile(os.path.join(ROOT, m.group(1)))
