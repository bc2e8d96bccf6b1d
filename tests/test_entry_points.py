"""Per-step, evaluation and launcher findings stay where programs run: a model-zoo package's
smoke tests (`def test(): net = Net(); print(net(torch.randn(...)).shape)`) and its model-only files
get none, while the training script that imports the models keeps every one of its findings."""

from __future__ import annotations

import json
from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

from torchopt.cli import app

CODES = "TOP801,TOP802,TOP803,TOP951"

RESNET = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    __all__ = ["ResNet", "ResNet18"]


    class BasicBlock(nn.Module):
        def __init__(self, planes):
            super().__init__()
            self.conv = nn.Conv2d(planes, planes, 3, padding=1)

        def forward(self, x):
            return F.relu(self.conv(x)) + x


    class ResNet(nn.Module):
        def __init__(self, blocks=2):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.layers = nn.Sequential(*[BasicBlock(8) for _ in range(blocks)])
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(self.layers(self.stem(x)).mean((2, 3)))


    def ResNet18():
        return ResNet(2)


    def test():
        net = ResNet18()
        y = net(torch.randn(2, 3, 32, 32))
        print(y.size())


    if __name__ == "__main__":
        test()
""")

# A smoke test written inline in the guard, and a helper with no guard at all (wrapping its input
# in the pre-0.4 `Variable`, as model zoos of that era do).
VGG = dedent("""\
    import torch
    from torch import nn
    from torch.autograd import Variable


    class VGG(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Conv2d(3, 8, 3)
            self.classifier = nn.Linear(8, 10)

        def forward(self, x):
            return self.classifier(self.features(x).mean((2, 3)))


    def test(depth=11):
        net = VGG()
        x = torch.randn(2, 3, 32, 32)
        print(depth, net(Variable(x)).shape)


    if __name__ == "__main__":
        net = VGG()
        print(net(torch.zeros(1, 3, 32, 32)).shape)
""")

TRAIN = dedent("""\
    import torch
    import torch.nn.functional as F

    from models import ResNet18


    def train(net, loader, opt):
        net.train()
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()


    def test(net, loader):
        correct = 0
        for x, y in loader:
            correct += (net(x).argmax(1) == y).sum().item()
        return correct


    def main():
        net = ResNet18()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        data = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))]
        for epoch in range(2):
            train(net, data, opt)
            print(test(net, data))


    if __name__ == "__main__":
        main()
""")


def _findings(root, folder: str = ".") -> set[tuple[str, int, str]]:
    """(path relative to ``root``, line, code) of every finding ``torchopt check`` prints for ``root/folder``."""
    args = ["check", str(root / folder), "--no-cache", "--select", CODES, "--output-format", "json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output
    rows = json.loads(r.stdout)
    return {(Path(row["path"]).resolve().relative_to(root).as_posix(), row["line"], row["code"]) for row in rows}


@pytest.fixture
def zoo(tmp_path):
    root = (tmp_path / "zoo").resolve()
    (root / "models").mkdir(parents=True)
    (root / "models" / "__init__.py").write_text("from .resnet import ResNet18\nfrom .vgg import VGG\n")
    (root / "models" / "resnet.py").write_text(RESNET)
    (root / "models" / "vgg.py").write_text(VGG)
    (root / "train.py").write_text(TRAIN)
    return root


def test_model_zoo_findings_only_in_the_training_script(zoo):
    assert _findings(zoo) == {("train.py", 15, "TOP801"), ("train.py", 15, "TOP803"), ("train.py", 31, "TOP951")}


@pytest.mark.parametrize(
    "helper",
    [
        # takes the model it runs: a step a program could call
        "def test(net):\n    print(net(torch.randn(2, 3, 32, 32)).shape)\n",
        # reads weights: an inference routine, not a smoke test
        "def test():\n    net = ResNet18()\n    net.load_state_dict(torch.load('w.pt'))\n    print(net(torch.randn(2, 3, 32, 32)).shape)\n",
        # loops over batches
        "def test():\n    net = ResNet18()\n    for _ in range(3):\n        print(net(torch.randn(2, 3, 32, 32)).shape)\n",
    ],
)
def test_code_that_is_not_a_smoke_test_keeps_its_findings(zoo, helper):
    start = RESNET.index("def test():")
    end = RESNET.index('if __name__ == "__main__":')
    (zoo / "models" / "resnet.py").write_text(RESNET[:start] + helper + "\n\n" + RESNET[end:])
    found = _findings(zoo, "models")
    assert {code for path, _, code in found if path == "models/resnet.py"} >= {"TOP801", "TOP803"}
    assert not {f for f in found if f[0] == "models/vgg.py"}  # its smoke tests stay quiet beside it


def test_a_model_file_that_runs_its_test_on_import_is_a_program(zoo):
    (zoo / "models" / "resnet.py").write_text(RESNET.replace('if __name__ == "__main__":\n    test()\n', "test()\n"))
    found = _findings(zoo, "models")
    assert {code for path, _, code in found if path == "models/resnet.py"} == {"TOP801", "TOP803"}
    assert not {f for f in found if f[0] == "models/vgg.py"}
