"""The real-world samples' benchmark: the split rules, the manifests' shape, judgements that survive line shifts."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import real_world_sample as rws  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MANIFEST = Path(__file__).parents[1] / "benchmarks" / "real_world_sample2.toml"


def finding(code: str, text: str, file: str = "train.py", line: int = 1, fix: str | None = None) -> rws.Finding:
    return rws.Finding(code=code, file=file, line=line, cell=None, text=text, message="", fix=fix)


def test_manifest_halves_follow_the_split_rule_and_keep_kinds_balanced() -> None:
    entries = tomllib.loads(MANIFEST.read_text(encoding="utf-8"))["entry"]
    halves = rws.assign_halves(entries)
    assert {(e["repository"], e["path"]): e["half"] for e in entries} == halves
    per_group = Counter((e["group"], e["half"]) for e in entries)
    for group in {e["group"] for e in entries}:
        assert abs(per_group[(group, "dev")] - per_group[(group, "held-back")]) <= 1


def test_held_back_entries_carry_no_judgements_until_the_half_is_measured() -> None:
    manifest = tomllib.loads(MANIFEST.read_text(encoding="utf-8"))
    measured = manifest.get("held_back_measured", "")
    if measured:  # measured once: the judgements are those of that run
        assert len(measured) >= 7 and all(c in "0123456789abcdef" for c in measured), measured
        return
    for e in manifest["entry"]:
        if e["half"] == "held-back":
            assert not e.get("judgements") and not e.get("misses") and not e.get("amp_targets"), e["path"]


def test_split_does_not_depend_on_manifest_order() -> None:
    entries = [{"repository": f"o/r{i}", "path": f"p{i}.py", "group": "g" if i % 3 else "h"} for i in range(9)]
    assert rws.assign_halves(entries) == rws.assign_halves(list(reversed(entries)))


def test_a_judgement_finds_its_finding_after_the_line_moved() -> None:
    judgement = {"code": "TOP601", "file": "train.py", "snippet": "loss.item()", "verdict": "false", "why": "x"}
    moved = finding("TOP601", "total += loss.item()", line=42)
    other_code = finding("TOP602", "total += loss.item()", line=42)
    stale = rws.judge([moved, other_code], [judgement])
    assert moved.judgement is judgement
    assert other_code.judgement is None
    assert stale == []


def test_unjudged_findings_and_fixes_are_counted_apart() -> None:
    judged = finding("TOP104", "x = x.to(device)", fix="safe")
    unknown = finding("TOP501", "model = Net()", fix="unsafe")
    stale = rws.judge(
        [judged, unknown],
        [
            {"code": "TOP104", "file": "train.py", "snippet": "x.to(device)", "verdict": "true", "fix": "wrong"},
            {"code": "TOP999", "file": "train.py", "snippet": "gone", "verdict": "false"},
        ],
    )
    result = rws.Result(findings=[judged, unknown])
    t = rws.tally({"misses": [{"code": "TOP202", "file": "train.py", "what": "x"}]}, result)
    assert (t.findings, t.true, t.false, t.unjudged) == (2, 1, 0, 1)
    assert (t.fixes, t.wrong_fixes, t.unjudged_fixes, t.misses) == (2, 1, 1, 1)
    assert [j["code"] for j in stale] == ["TOP999"]


@pytest.mark.parametrize(
    ("judged_fix", "applied", "expected"), [("right", 1, (1, 1)), ("wrong", 1, (1, 0)), ("right", 0, (0, 0))]
)
def test_amp_target_counts_only_an_applied_fix_judged_right(judged_fix: str, applied: int, expected: tuple) -> None:
    f = finding("TOP202", "loss = criterion(model(x), y)", fix="unsafe")
    rws.judge(
        [f], [{"code": "TOP202", "file": "train.py", "snippet": "criterion(", "verdict": "true", "fix": judged_fix}]
    )
    entry = {"amp_targets": [{"file": "train.py", "snippet": "criterion(model"}]}
    t = rws.tally(entry, rws.Result(findings=[f], all_fixes=Counter({"TOP202": applied})))
    assert (t.amp_inserted, t.amp_right) == expected


def test_source_line_reads_a_notebook_cell(tmp_path: Path) -> None:
    nb = tmp_path / "nb.ipynb"
    nb.write_text('{"cells": [{"source": ["a = 1\\n", "b = model(x)\\n"]}]}', encoding="utf-8")
    assert rws.source_line(tmp_path, "nb.ipynb", 2, 1) == "b = model(x)"  # cells count from 1, as torchopt says
    assert rws.source_line(tmp_path, "nb.ipynb", 9, 1) == ""


MANIFEST3 = MANIFEST.with_name("real_world_sample3.toml")
MANIFEST4 = MANIFEST.with_name("real_world_sample4.toml")
FIRST_SAMPLE = MANIFEST.with_name("real_world.json")


def earlier_entries(*manifests: Path) -> list[tuple[str, str, str]]:
    """(repository, path, unit) of every entry of the first sample and of the given TOML manifests (by
    default the second sample)."""
    first = json.loads(FIRST_SAMPLE.read_text(encoding="utf-8"))["scripts"]
    later = [e for m in manifests or (MANIFEST,) for e in tomllib.loads(m.read_text(encoding="utf-8"))["entry"]]
    return [(e["repository"], e["path"], "script") for e in first] + [
        (e["repository"], e["path"], e["unit"]) for e in later
    ]


def within(folder: str, path: str) -> bool:
    return folder in (".", "") or path == folder or path.startswith(folder.rstrip("/") + "/")


def test_third_manifest_is_held_back_whole_and_large_enough() -> None:
    manifest = tomllib.loads(MANIFEST3.read_text(encoding="utf-8"))
    entries = manifest["entry"]
    assert manifest["split"] == "held-back"
    assert all(e["half"] == "held-back" for e in entries)
    assert set(rws.expected_halves(manifest).values()) == {"held-back"}
    assert len(entries) >= 32
    assert sum(e["unit"] == "project" for e in entries) >= 8
    assert len({e["repository"] for e in entries}) >= 12
    assert {e["group"] for e in entries} == {"project", "notebook", "negative", "inference", "training"}
    assert sum(e["path"].endswith(".ipynb") for e in entries) >= 4
    assert all(len(e["commit"]) == 40 and all(c in "0123456789abcdef" for c in e["commit"]) for e in entries)


def assert_disjoint(entries: list[dict], earlier: list[tuple[str, str, str]]) -> None:
    for e in entries:
        for repository, path, unit in earlier:
            if repository != e["repository"]:
                continue
            assert path != e["path"], (repository, path)
            if e["unit"] == "project":  # a project holds no file an earlier entry measured
                assert not within(e["path"], path), (e["path"], path)
            if unit == "project":  # nor lies inside an earlier project
                assert not within(path, e["path"]), (path, e["path"])
    names = [(e["repository"], e["path"]) for e in entries]
    assert len(names) == len(set(names))
    for project in (e for e in entries if e["unit"] == "project"):  # nor one of this sample's other entries
        inside = [p for r, p in names if r == project["repository"] and p != project["path"]]
        assert not any(within(project["path"], p) for p in inside), project["path"]


def test_third_manifest_is_disjoint_from_the_earlier_samples() -> None:
    assert_disjoint(tomllib.loads(MANIFEST3.read_text(encoding="utf-8"))["entry"], earlier_entries())


def test_fourth_manifest_is_held_back_whole_and_large_enough() -> None:
    manifest = tomllib.loads(MANIFEST4.read_text(encoding="utf-8"))
    entries = manifest["entry"]
    assert manifest["split"] == "held-back"
    assert all(e["half"] == "held-back" for e in entries)
    assert set(rws.expected_halves(manifest).values()) == {"held-back"}
    assert len(entries) >= 36
    assert sum(e["unit"] == "project" for e in entries) >= 8
    repositories = Counter(e["repository"] for e in entries)
    assert len(repositories) >= 16 and max(repositories.values()) <= 4
    third = {e["repository"] for e in tomllib.loads(MANIFEST3.read_text(encoding="utf-8"))["entry"]}
    assert len(set(repositories) - third) >= 12
    assert {e["group"] for e in entries} == {"project", "notebook", "negative", "inference", "training"}
    assert sum(e["path"].endswith(".ipynb") for e in entries) >= 4
    assert sum(e["group"] == "training" and "single-GPU float32" in e["kind"] for e in entries) >= 10
    assert all(len(e["commit"]) == 40 and all(c in "0123456789abcdef" for c in e["commit"]) for e in entries)


def test_fourth_manifest_is_disjoint_from_the_earlier_samples() -> None:
    entries = tomllib.loads(MANIFEST4.read_text(encoding="utf-8"))["entry"]
    assert_disjoint(entries, earlier_entries(MANIFEST, MANIFEST3))


def test_third_and_fourth_samples_together_make_the_new_sample() -> None:
    entries = [e for m in (MANIFEST3, MANIFEST4) for e in tomllib.loads(m.read_text(encoding="utf-8"))["entry"]]
    assert len(entries) >= 60
    assert len({e["repository"] for e in entries}) >= 25
    assert sum(e["unit"] == "project" for e in entries) >= 10


@pytest.mark.parametrize("manifest", [MANIFEST, MANIFEST3, MANIFEST4], ids=["sample2", "sample3", "sample4"])
def test_held_back_entries_carry_no_judgement_until_measured(manifest: Path) -> None:
    data = tomllib.loads(manifest.read_text(encoding="utf-8"))
    if data.get("held_back_measured"):
        return
    for e in data["entry"]:
        if e["half"] == "held-back":
            assert not e.get("judgements") and not e.get("misses") and not e.get("amp_targets"), e["path"]


def test_a_manifest_split_applies_to_every_entry_and_must_name_a_half() -> None:
    entries = [{"repository": "o/r", "path": f"p{i}.py", "group": "g"} for i in range(4)]
    assert set(rws.expected_halves({"entry": entries, "split": "held-back"}).values()) == {"held-back"}
    assert rws.expected_halves({"entry": entries}) == rws.assign_halves(entries)
    with pytest.raises(ValueError, match="split"):
        rws.expected_halves({"entry": entries, "split": "later"})


def test_the_benchmark_refuses_an_entry_whose_half_disagrees_with_the_manifest_split(tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        'split = "held-back"\n[[entry]]\nrepository = "o/r"\npath = "a.py"\ncommit = "0"\nunit = "script"\n'
        'group = "training"\nkind = "x"\nhalf = "dev"\n',
        encoding="utf-8",
    )
    assert rws.main([str(tmp_path), "--manifest", str(manifest), "--no-run", "--results", str(tmp_path)]) == 2
    manifest.write_text(manifest.read_text(encoding="utf-8").replace('half = "dev"', 'half = "held-back"'))
    # held back whole: that half is the default, and an entry with no saved result is not run under --no-run
    assert rws.main([str(tmp_path), "--manifest", str(manifest), "--no-run", "--results", str(tmp_path)]) == 0


def test_a_miss_found_by_a_later_commit_no_longer_counts() -> None:
    """A miss stays in the manifest as the record of the run that judged it; once a later commit is
    judged by hand to find it (``found``), the tally counts it no more and the details say so."""
    misses = [
        {"code": "TOP101", "file": "train.py", "what": "an arange built on the host every step", "found": "abc1234"},
        {"code": "TOP601", "file": "train.py", "what": "a read in a helper"},
    ]
    t = rws.tally({"misses": misses}, rws.Result(findings=[]))
    assert t.misses == 1
    lines = rws.finding_lines({"repository": "o/r", "path": "train.py", "misses": misses}, rws.Result(findings=[]), [])
    assert "- FOUND at abc1234 TOP101 train.py: an arange built on the host every step" in lines
    assert "- MISS TOP601 train.py: a read in a helper" in lines


def test_two_findings_on_one_line_take_their_own_judgements() -> None:
    """Both snippets are in the line of each finding: the second finding takes the judgement the first
    did not, so neither is listed as no longer reported."""
    line = "self.mlp = Sequential(Linear(75, 50), ReLU(), Linear(50, 25))"
    first, second = finding("TOP302", line), finding("TOP302", line)
    judgements = [
        {"code": "TOP302", "file": "train.py", "snippet": "Linear(75, 50)", "verdict": "true", "why": "a"},
        {"code": "TOP302", "file": "train.py", "snippet": "Linear(50, 25)", "verdict": "true", "why": "b"},
    ]
    assert rws.judge([first, second], judgements) == []
    assert (first.judgement, second.judgement) == (judgements[0], judgements[1])


def test_a_judgement_with_a_line_takes_only_the_finding_on_that_line() -> None:
    """Two findings on identical lines (`lossf = loss.item()` at 91 and 110): when one is no longer
    reported, the other keeps its own judgement, not the first one whose snippet matches."""
    finding = rws.Finding("TOP601", "bench.py", 110, None, "lossf = loss.item()", "m", None)
    judgements = [
        {"code": "TOP601", "file": "bench.py", "snippet": "lossf = loss.item()", "line": 91, "verdict": "false"},
        {"code": "TOP601", "file": "bench.py", "snippet": "lossf = loss.item()", "line": 110, "verdict": "true"},
    ]
    left = rws.judge([finding], judgements)
    assert finding.judgement is judgements[1] and left == [judgements[0]]
