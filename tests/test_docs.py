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
    cmd = next(line for line in ci.splitlines() if "pytest" in line and "pip install" in line)
    assert cmd.strip() in readme


def test_readme_main_command_names_a_bundled_fixture():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"torchopt rewrite (fixtures/\S+) --diff", readme)
    assert m and os.path.isfile(os.path.join(ROOT, m.group(1)))


def test_every_topic_without_a_code_names_rules_that_exist_and_is_in_the_index():
    """A reader who looks up a topic in the rule index is sent to a rule that really handles it."""
    from torchopt.codemods import SHARED_TOPICS
    from torchopt.rewrite.registry import all_rules

    rules = all_rules()
    with open(os.path.join(ROOT, "docs", "rules", "README.md"), encoding="utf-8") as fh:
        index = fh.read()
    assert SHARED_TOPICS
    for topic, (codes, how) in SHARED_TOPICS.items():
        assert codes and all(code in rules for code in codes), f"{topic}: {codes} is not a rule"
        assert f"| {topic} |" in index and how in index, f"{topic} is missing from docs/rules/README.md"


def test_docs_name_no_document_outside_the_repository():
    """Pages a user reads stand alone: no pointer to a specification that is not shipped, nor to
    its entry names (a family abbreviation, a dash and a number) or its numbered sections."""
    families = "E|G|P|VAL|DEV|AMP|PAD|DDP|FLAG|SYNC|DATA|MEM|INF|DBG|DEP|ZG|CBN|CL|CMP|CG|CKPT|ENV"
    outside = re.compile(rf"rules\.md|\.\./shared|\bcatalog|§|\b(?:{families})-[0-9]+[a-z]?\b")
    folders = [os.path.join(ROOT, "docs"), os.path.join(ROOT, "fixtures")]
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CONTRIBUTING.md")]
    for folder in folders:
        for dirpath, _, names in os.walk(folder):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".md")]
    hits = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if outside.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{number}")
    assert not hits, f"references to documents outside the repository: {hits}"


def test_rules_command_lists_every_code_with_its_safety():
    import json

    from typer.testing import CliRunner

    from torchopt.cli import app
    from torchopt.rewrite.registry import all_rules

    res = CliRunner().invoke(app, ["rules", "--output-format", "json"])
    assert res.exit_code == 0, res.output
    listed = {r["code"]: r for r in json.loads(res.stdout)}
    assert set(listed) == set(all_rules())
    assert {r["fix"] for r in listed.values()} == {"safe", "unsafe", "display-only"}
