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


# The rule catalogue's index (rules.md, "FAM-00N becomes TOP + family digits + N").
CATALOGUE = {
    "DEV": (1, 5, "TOP10"), "AMP": (1, 7, "TOP20"), "PAD": (1, 3, "TOP30"), "DDP": (1, 9, "TOP40"),
    "FLAG": (1, 3, "TOP50"), "SYNC": (1, 9, "TOP60"), "DATA": (1, 4, "TOP70"), "MEM": (1, 1, "TOP71"),
    "INF": (1, 3, "TOP80"), "DBG": (1, 5, "TOP81"), "DEP": (1, 10, "TOP82"), "ZG": (1, 2, "TOP83"),
    "CBN": (1, 1, "TOP84"), "CL": (1, 1, "TOP90"), "CMP": (1, 1, "TOP91"), "CG": (1, 2, "TOP92"),
    "CKPT": (1, 1, "TOP93"),
}


def _catalogue_codes() -> dict[str, str]:
    out = {}
    for fam, (lo, hi, prefix) in CATALOGUE.items():
        for n in range(lo, hi + 1):
            out[f"{fam}-{n:03d}"] = prefix + str(n % 10)
    return out


def test_every_catalogue_entry_has_a_rule_or_a_documented_reason():
    from torchopt.codemods import CATALOGUE_NOTES
    from torchopt.rewrite.registry import all_rules

    rules = all_rules()
    with open(os.path.join(ROOT, "docs", "rules", "README.md"), encoding="utf-8") as fh:
        index = fh.read()
    missing = []
    for entry, code in _catalogue_codes().items():
        if code in rules:
            continue
        note = CATALOGUE_NOTES.get(entry)
        if note is None or note[0] != code or f"| {entry} | {code} |" not in index:
            missing.append(f"{entry} ({code})")
    assert not missing, f"catalogue entries with neither a rule nor a line in docs/rules/README.md: {missing}"


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
