"""Backend switches on real layouts: where every process runs them (a spawned worker), CUDA
programs whose device comes from `torch.accelerator` or an index, and the cuDNN auto-tuner
against input shapes that vary per batch."""

from __future__ import annotations

from layout_cases import check, rewrite

SPAWNED = """\
import torch
import torch.multiprocessing as mp
import torch.nn as nn


def worker(rank, world_size):
    model = nn.Conv2d(3, 8, 3).to(rank)
    for _ in range(3):
        model(torch.randn(2, 3, 8, 8).to(rank)).sum().backward()


def main():
    mp.spawn(worker, args=(2,), nprocs=2)


if __name__ == "__main__":
    main()
"""


def test_switch_goes_into_the_spawned_worker(tmp_path):
    res, text = rewrite(tmp_path, SPAWNED, "--unsafe-fixes", "--select", "TOP501")
    assert res.exit_code == 0
    assert text == SPAWNED.replace(
        "def worker(rank, world_size):\n", "def worker(rank, world_size):\n    torch.backends.cudnn.benchmark = True\n"
    )


ACCELERATOR = """\
import torch
import torch.nn as nn


def main():
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    model = nn.Linear(8, 8).to(device)
    for _ in range(3):
        model(torch.randn(4, 8).to(device)).sum().backward()


if __name__ == "__main__":
    main()
"""


def test_tf32_for_a_device_from_torch_accelerator(tmp_path):
    res, text = rewrite(tmp_path, ACCELERATOR, "--unsafe-fixes", "--select", "TOP502")
    assert res.exit_code == 0
    assert text == ACCELERATOR.replace("def main():\n", 'def main():\n    torch.set_float32_matmul_precision("high")\n')


def test_tf32_for_a_device_given_as_an_index(tmp_path):
    src = (
        "import torch\nimport torch.nn as nn\n\n\nclass Trainer:\n    def __init__(self, model, gpu_id):\n"
        "        self.gpu_id = gpu_id\n        self.model = model.to(gpu_id)\n\n"
        "    def run(self, batches):\n        for x in batches:\n            self.model(x.to(self.gpu_id)).sum().backward()\n\n\n"
        "def main(device):\n    trainer = Trainer(nn.Linear(8, 8), device)\n    trainer.run(torch.randn(3, 2, 8))\n\n\n"
        'if __name__ == "__main__":\n    main(0)\n'
    )
    res = check(tmp_path, src, "--select", "TOP502")
    assert res.exit_code == 1 and "main.py:16:23: TOP502" in res.stdout


VARYING = """\
import random

import torch.backends.cudnn as cudnn
import torch.nn.functional as F
from torchvision import models

cudnn.benchmark = True
net = models.resnet18().cuda()
for images, labels in loader:
    size = random.choice([224, 256, 288])
    net(F.interpolate(images.cuda(), size=size)).sum().backward()
"""


def test_benchmark_on_with_multi_scale_inputs_is_advised_off(tmp_path):
    res = check(tmp_path, VARYING, "--select", "TOP504")
    assert res.exit_code == 1
    assert "main.py:7:1: TOP504" in res.stdout and "set it to `False`" in res.stdout
    assert "`interpolate` gets a size drawn at random (multi-scale)" in res.stdout


def test_auto_tuner_not_inserted_for_random_size_augmentation(tmp_path):
    src = (
        "import torch\nfrom torchvision import models, transforms\n\n"
        "augment = transforms.v2.RandomShortestSize([480, 512, 544])\nnet = models.resnet18().cuda()\n"
        "for images in loader:\n    net(augment(images).cuda()).sum().backward()\n"
    )
    res, text = rewrite(tmp_path, src, "--unsafe-fixes", "--select", "TOP501")
    assert res.exit_code == 0 and text == src
    res = check(tmp_path / "c", src, "--select", "TOP501")
    assert "`RandomShortestSize` draws a new image size for every sample" in res.stdout
