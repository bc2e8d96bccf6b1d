"""The project index (torchopt/analysis/project.py): names of the analysed file resolved through the
project's own imports into facts about other modules, explicit unknowns when a module is not part of
the run, and the cache that holds a file's result only while the modules it read are unchanged."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

import torchopt.cli
from torchopt.analysis.project import Definition, ProjectIndex, Unknown
from torchopt.analysis.project_summary import ModuleSummary, summarize
from torchopt.rewrite.cache import Cache
from torchopt.rewrite.projectscope import ProjectScope, unchanged


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dedent(text), encoding="utf-8")


def _index(root: Path, rel: str, scope: ProjectScope | None = None) -> ProjectIndex:
    path = root / rel
    scope = scope or ProjectScope(folders=[str(root)])
    return ProjectIndex(scope, str(path), summarize(ast.parse(path.read_text(encoding="utf-8"))))


PROJECT = {
    "main.py": """\
        import torch
        import utils
        from models import resnet18, Net
        from engine.loop import train_one_epoch

        if __name__ == "__main__":
            args = utils.parse()
            net = Net()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    """,
    "utils.py": """\
        def parse():
            return None


        def loader_kwargs(args):
            return dict(batch_size=args.batch_size, pin_memory=True)
    """,
    "models/__init__.py": """\
        from .net import Net
        from .resnet import resnet18
    """,
    "models/base.py": """\
        import torch.nn as nn


        class Base(nn.Module):
            pass
    """,
    "models/net.py": """\
        from torch import nn
        from models.base import Base


        class Net(Base):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(784, 250)
                self.drop = nn.Dropout(0.5)
                self.fc2 = nn.Linear(250, 10)
    """,
    "models/resnet.py": """\
        import torch.nn as nn


        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3)
                self.bn = nn.BatchNorm2d(8)


        class ResNet(nn.Module):
            def __init__(self, block):
                super().__init__()
                self.layer = block()


        def resnet18():
            return ResNet(Block)
    """,
    "engine/__init__.py": "",
    "engine/loop.py": """\
        import torch
        from .metrics import accuracy


        def train_one_epoch(model, data_loader, optimizer, epoch):
            for step, (x, y) in enumerate(data_loader):
                loss = model(x).mean()
                loss.backward()
                optimizer.step()


        @torch.no_grad()
        def evaluate(model, data_loader):
            return [accuracy(model(x), y) for x, y in data_loader]
    """,
    "engine/metrics.py": """\
        def accuracy(out, y):
            return (out.argmax(1) == y).float().mean()
    """,
}


def test_names_resolve_through_the_projects_own_imports(tmp_path):
    _write(tmp_path, PROJECT)
    ix = _index(tmp_path, "main.py")
    net = ix.resolve("Net")  # `from models import Net`, re-exported by models/__init__.py
    assert isinstance(net, Definition) and net.kind == "class"
    assert net.path == os.path.realpath(tmp_path / "models" / "net.py")
    assert ix.is_module_class(net) is True  # through the project base `Base(nn.Module)`
    layers = ix.layers(net)
    assert layers.counts == {"linear": 2, "dropout": 1} and layers.widths == [784, 250, 250, 10]

    resnet = ix.resolve("resnet18")  # a factory function: what it builds, through the classes it calls
    assert isinstance(resnet, Definition) and resnet.kind == "function"
    assert ix.layers(resnet).counts == {"conv": 1, "norm": 1}
    assert ix.layers(resnet).where == ["models/resnet.py"]

    helper = ix.resolve("utils.loader_kwargs")  # `import utils`, then an attribute
    assert isinstance(helper, Definition) and helper.unit is not None
    assert helper.unit.returns_dict == {"batch_size": "args.batch_size", "pin_memory": "True"}

    step = ix.resolve("train_one_epoch")  # a package module, which imports relatively itself
    assert isinstance(step, Definition) and step.unit is not None
    assert step.unit.steps and step.unit.iterates == ["data_loader"] and not step.unit.no_grad
    loop = ix.summary(str(tmp_path / "engine" / "loop.py"))
    assert loop is not None and loop.functions["evaluate"].no_grad and not loop.functions["evaluate"].steps

    assert ix.own.main_globals == ["args", "net", "optimizer"]
    assert ix.resolve("torch.optim.SGD") is None  # a library: not the project's
    assert ix.resolve("undefined_name") is None


def test_a_module_outside_the_run_is_an_explicit_unknown(tmp_path):
    _write(tmp_path, PROJECT)
    alone = ProjectScope(files=[str(tmp_path / "main.py")])  # `torchopt check main.py`, no project folder
    got = _index(tmp_path, "main.py", alone).resolve("Net")
    assert isinstance(got, Unknown)
    assert got.reason == "`Net` comes from models/__init__.py, which is not part of this run"
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = toy\n", encoding="utf-8")
    seen = _index(tmp_path, "main.py", ProjectScope(files=[str(tmp_path / "main.py")])).resolve("Net")
    assert isinstance(seen, Definition)  # a project folder: its other files may be read


def test_summaries_are_kept_in_the_cache_and_a_forged_one_is_not_believed(tmp_path):
    _write(tmp_path / "proj", {"models.py": "import torch.nn as nn\nclass Net(nn.Module):\n    pass\n"})
    cache = Cache.open(str(tmp_path / "cache"), rules={}, key_home=str(tmp_path / "key"))
    assert cache is not None
    path = str(tmp_path / "proj" / "models.py")
    made: list[str] = []

    def make(text: str) -> ModuleSummary:
        made.append(text)
        return summarize(ast.parse(text))

    def fact(scope: ProjectScope) -> ModuleSummary | None:
        return scope.file_fact(path, "module summary", make, ModuleSummary.to_json, ModuleSummary.from_json)

    first = fact(ProjectScope(cache=cache))
    again = fact(ProjectScope(cache=cache))  # another run: from the cache, not parsed again
    assert len(made) == 1 and first is not None and again is not None and list(again.classes) == ["Net"]
    entry = next(p for p in (tmp_path / "cache").rglob("*.json"))
    mac, _, body = entry.read_bytes().partition(b"\n")
    forged = json.loads(body)
    forged["value"]["classes"] = {}
    entry.write_bytes(mac + b"\n" + json.dumps(forged).encode())
    third = fact(ProjectScope(cache=cache))
    assert len(made) == 2 and third is not None and list(third.classes) == ["Net"]


def test_a_recorded_dependency_changes_or_appears(tmp_path):
    _write(tmp_path, {"a.py": "x = 1\n"})
    scope = ProjectScope(folders=[str(tmp_path)])
    with scope.recording() as deps:
        scope.text(str(tmp_path / "a.py"))
        scope.exists(str(tmp_path / "b.py"))
    assert [os.path.basename(p) for p, _ in deps] == ["a.py", "b.py"] and unchanged(deps)
    (tmp_path / "b.py").write_text("y = 2\n", encoding="utf-8")
    assert not unchanged(deps)
    (tmp_path / "b.py").unlink()
    (tmp_path / "a.py").write_text("x = 2\n", encoding="utf-8")
    assert not unchanged(deps)


ENTRY = """\
    import torch
    from models import Net


    def main():
        net = Net().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(10):
            loss = net(torch.randn(16, 3, 32, 32, device="cuda")).mean()
            loss.backward()
            opt.step()


    if __name__ == "__main__":
        main()
"""
MODELS = {
    "models/__init__.py": "from .net import Net\n",
    "models/net.py": """\
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = nn.Conv2d(3, 8, 3)
    """,
}


def _cli(*args: str):
    return CliRunner().invoke(torchopt.cli.app, list(args), catch_exceptions=False)


def test_a_single_file_says_which_module_it_could_not_read(tmp_path, monkeypatch):
    _write(tmp_path / "proj", {"main.py": ENTRY, **MODELS})
    monkeypatch.chdir(tmp_path)
    r = _cli("check", "proj/main.py", "--no-cache", "--select", "TOP501")
    assert r.exit_code == 1, r.output
    assert r.stdout.strip() == (
        "proj/main.py:6:11: TOP501 Whether this program builds convolutions (and the cuDNN auto-tuner "
        "would pay) is unknown: `Net` comes from models/__init__.py, which is not part of this run; "
        "check the whole project (`torchopt check <project folder>`)"
    )
    assert "0 fixable with `--fix`." in r.stderr and "--unsafe-fixes" not in r.stderr  # without a fix
    whole = _cli("check", "proj", "--no-cache", "--select", "TOP501")
    assert "TOP501 [unsafe fix] This program builds convolutions (`Net()`, built in models/net.py)" in whole.stdout


def test_the_cached_result_of_a_file_goes_when_a_module_it_read_changes(tmp_path, monkeypatch):
    _write(tmp_path / "proj", {"main.py": ENTRY, **MODELS})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    args = ("check", "proj", "--cache-dir", str(tmp_path / "cache"), "--select", "TOP501", "-j", "1")
    assert "TOP501" in _cli(*args).stdout
    assert "TOP501" in _cli(*args).stdout  # answered from the cache
    net = tmp_path / "proj" / "models" / "net.py"
    net.write_text(net.read_text(encoding="utf-8").replace("nn.Conv2d(3, 8, 3)", "nn.Linear(3, 8)"), encoding="utf-8")
    r = _cli(*args)
    assert r.exit_code == 0 and "TOP501" not in r.stdout, r.output


DP_MAIN = """\
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    from engine import train_one_epoch


    def main():
        dataset = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
        loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)
        model = nn.DataParallel(nn.Linear(16, 4)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(3):
            train_one_epoch(model, loader, optimizer, epoch)


    if __name__ == "__main__":
        main()
"""
DP_ENGINE = """\
    def train_one_epoch(model, data_loader, optimizer, epoch):
        model.train()
        for inputs, targets in data_loader:
            loss = model(inputs).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
"""


def test_the_ddp_conversion_follows_the_loader_into_a_step_of_another_module(tmp_path, monkeypatch):
    _write(tmp_path / "proj", {"main.py": DP_MAIN, "engine.py": DP_ENGINE})
    monkeypatch.chdir(tmp_path)
    r = _cli("rewrite", "proj", "--no-cache", "--unsafe-fixes", "--select", "TOP401", "-j", "1")
    assert r.exit_code == 0, r.output
    main = (tmp_path / "proj" / "main.py").read_text(encoding="utf-8")
    assert "sampler = DistributedSampler(dataset, shuffle=True) if world_size > 1 else None" in main
    epoch_loop = main[main.index("for epoch in range(3):") :]
    assert epoch_loop.splitlines()[1:4] == [
        "        if sampler is not None:",
        "            sampler.set_epoch(epoch)  # a new shuffle every epoch",
        "        train_one_epoch(model, loader, optimizer, epoch)",
    ], main
    assert (tmp_path / "proj" / "engine.py").read_text(encoding="utf-8") == dedent(DP_ENGINE)
