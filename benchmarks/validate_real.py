"""`torchopt validate` on real public training scripts, on the CPU, with synthetic data.

    python benchmarks/validate_real.py [--src /tmp/realworld] [--work /tmp/validate-real] [--only NAME]
                                       [--mode safe|unsafe|both] [--steps N]

The scripts themselves are never part of this repository. ``--src`` holds checkouts laid out as
``<owner>+<repo>/...`` (e.g. made with ``git --git-dir=DIR show HEAD:path``); each case copies the
files it needs to ``--work/<case>/``, patches that copy (below: what and why, per case), adds
synthetic data, and runs ``torchopt validate SCRIPT --device cpu --json`` twice: safe fixes, then
``--unsafe-fixes``. A verdict is *right* when it is the expected one: EQUIVALENT for a correct
rewrite, DIVERGED naming the fix for one that really breaks the program (``expect`` per case).
Prints a Markdown table (the rows of the tables in docs/validation.md, with each run's largest
loss difference as a fraction of the loss scale) and writes ``validate_real.json``.

The scripts run unchanged: tiny configurations and synthetic data come from their own arguments
(nanoGPT's configurator.py overrides, ``--dummy``, ``--dataset fake``), synthetic data files, a
deterministic stand-in for ``torchvision``, and, where a script hard-codes its device in its
``__main__`` block, a wrapper module of ours that calls the script's own ``main()`` through
``--entry``. One case (the torchrun script, which needs gloo and no device ids on the CPU) is a
patched copy; its patches are listed with it and it is not counted among the unchanged scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for torchvision (not installed with torchopt): the datasets the examples load,
# made of deterministic synthetic tensors, and the transforms they use on them.
TORCHVISION = {
    "torchvision/__init__.py": "from . import datasets, transforms, utils, models\n",
    "torchvision/transforms.py": """\
import torch


class Compose:
    def __init__(self, ts):
        self.ts = ts

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, x):
        return x


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


def _identity(*args, **kwargs):
    return lambda x: x


Resize = CenterCrop = RandomResizedCrop = RandomHorizontalFlip = _identity
""",
    "torchvision/datasets.py": '''\
import torch


class FakeData(torch.utils.data.Dataset):
    """Deterministic images: item i is drawn from a generator seeded with i."""

    def __init__(self, size=256, image_size=(3, 32, 32), num_classes=10, transform=None, **kwargs):
        self.size, self.image_size, self.num_classes, self.transform = size, image_size, num_classes, transform

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.rand(self.image_size, generator=g)
        y = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return (self.transform(x) if self.transform else x), y


class MNIST(FakeData):
    """FakeData in MNIST's shape, with MNIST's ``data`` (uint8 images) and ``targets`` attributes."""

    def __init__(self, root, train=True, download=False, transform=None, **kwargs):
        super().__init__(256 if train else 64, (1, 28, 28), 10, transform)
        items = [FakeData.__getitem__(self, i) for i in range(self.size)] if transform is None else []
        if items:
            self.data = torch.stack([(x[0] * 255).to(torch.uint8) for x, _ in items])
            self.targets = torch.tensor([y for _, y in items])
        else:
            raw = MNIST(root, train)
            self.data, self.targets = raw.data, raw.targets


def ImageFolder(root, transform=None, **kwargs):
    return FakeData(64, (3, 64, 64), 10, transform)
''',
    "torchvision/utils.py": "def save_image(*args, **kwargs):\n    pass\n",
    "torchvision/models.py": '''\
import torch.nn as nn


class TinyResNet(nn.Module):
    """ResNet's attribute names (conv1 ... fc, fc last among the children), a tiny CNN inside."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=4, padding=3, bias=False)  # ResNet's stem width
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(self.avgpool(self.relu(self.bn1(self.conv1(x)))).flatten(1))


def resnet18(pretrained=False, weights=None, num_classes=1000, **kwargs):
    """A tiny CNN under the ImageNet example's default architecture name (1000 classes, as FakeData's)."""
    return TinyResNet(num_classes)
''',
}


@dataclass
class Case:
    name: str
    kind: str
    repo: str  # <owner>+<repo> under --src
    files: tuple[str, ...]  # copied from the repo (the first one is the script)
    patches: tuple[tuple[str, str, str], ...] = ()  # (file, old, new): every `old` must occur
    args: tuple[str, ...] = ()
    steps: int = 3
    extra: dict[str, str] = field(default_factory=dict)  # more files to write
    data: str = ""  # a synthetic-data recipe (see make_data)
    nproc: int = 1  # > 1: validated under torchrun with this many ranks (gloo on the CPU)
    entry: str = ""  # MODULE:FUNC of a wrapper (in ``extra``) that calls the script's own main()
    expect: dict[str, str] = field(default_factory=lambda: {"safe": "equivalent", "unsafe": "equivalent"})
    # Epoch counts in ``args`` give each script at least 20 optimizer steps, so ``--steps 20`` (the
    # AMP measurements in docs/validation.md) stops the run rather than the script ending first.

    @property
    def script(self) -> str:
        return os.path.basename(self.files[0])


CASES = [
    # nanoGPT's own configurator.py takes --key=value overrides of its configuration globals.
    Case(
        "nanoGPT train.py",
        "GPT LM, wall-clock logging, AdamW, GradScaler",
        "karpathy+nanoGPT",
        ("train.py", "model.py", "configurator.py"),
        args=(
            "--device=cpu",
            "--compile=False",
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=16",
            "--block_size=16",
            "--batch_size=2",
            "--gradient_accumulation_steps=2",
            "--eval_interval=100000",
            "--eval_iters=1",
        ),
        data="nanogpt",
        steps=4,
    ),
    Case(
        "examples mnist/main.py",
        "CNN, Adadelta, StepLR, argparse",
        "pytorch+examples",
        ("mnist/main.py",),
        args=("--batch-size", "16", "--epochs", "2"),
        extra=TORCHVISION,
    ),
    Case(
        "examples vae/main.py",
        "VAE, Adam, save_image",
        "pytorch+examples",
        ("vae/main.py",),
        args=("--batch-size", "16", "--epochs", "2"),
        extra=TORCHVISION,
    ),
    Case(
        "examples word_language_model/main.py",
        "LSTM LM, tuple hidden state, repackage_hidden",
        "pytorch+examples",
        ("word_language_model/main.py", "word_language_model/model.py", "word_language_model/data.py"),
        args=(
            "--emsize",
            "16",
            "--nhid",
            "16",
            "--bptt",
            "8",
            "--batch_size",
            "4",
            "--epochs",
            "2",
            "--use-optimizer",
            "--lr",
            "0.01",
            "--data",
            "./corpus",
        ),
        data="corpus",
    ),
    # The script's own main() runs it on cuda:0 (`device = 0` under `if __name__ == "__main__":`); a
    # wrapper of ours calls that main() with "cpu", through --entry, so the script itself is unchanged.
    Case(
        "examples ddp-tutorial-series/single_gpu.py",
        "trainer class, SGD, checkpoints",
        "pytorch+examples",
        ("distributed/ddp-tutorial-series/single_gpu.py", "distributed/ddp-tutorial-series/datautils.py"),
        extra={"run_on_cpu.py": "import single_gpu\n\n\ndef run():\n    single_gpu.main('cpu', 3, 1, 8)\n"},
        entry="run_on_cpu:run",
    ),
    # --dataset fake is the script's own synthetic data (the stand-in FakeData); 64x64 is the only image
    # size its layer stack accepts, so the model is shrunk through --nz/--ngf/--ndf instead.
    Case(
        "examples dcgan/main.py",
        "GAN, two Adam optimizers, BCELoss, argparse",
        "pytorch+examples",
        ("dcgan/main.py",),
        args=(
            "--dataset",
            "fake",
            "--workers",
            "0",
            "--batchSize",
            "8",
            "--imageSize",
            "64",
            "--nz",
            "16",
            "--ngf",
            "8",
            "--ndf",
            "8",
            "--niter",
            "1",
        ),
        extra=TORCHVISION,
    ),
    # --dummy is the script's own synthetic data (FakeData at 224x224, 1000 classes); resnet18 is the
    # stand-in's tiny CNN.
    Case(
        "examples imagenet/main.py",
        "ImageNet-style, argparse, SGD + StepLR, AverageMeter, --dummy data",
        "pytorch+examples",
        ("imagenet/main.py",),
        args=("--dummy", "-a", "resnet18", "-j", "0", "-b", "4", "--epochs", "1", "-p", "1"),
        extra=TORCHVISION,
    ),
    # torchvision's resnet18 and MNIST are the stand-in's (a tiny CNN with ResNet's attribute names;
    # FakeData with MNIST's `data` and `targets`).
    Case(
        "examples siamese_network/main.py",
        "siamese CNN, pairs from MNIST, BCELoss, Adadelta, StepLR",
        "pytorch+examples",
        ("siamese_network/main.py",),
        args=("--batch-size", "16", "--test-batch-size", "32", "--epochs", "2", "--no-accel"),
        extra=TORCHVISION,
    ),
    Case(
        "examples mnist_rnn/main.py",
        "LSTM classifier, Adadelta, StepLR, argparse",
        "pytorch+examples",
        ("mnist_rnn/main.py",),
        args=("--batch-size", "16", "--epochs", "2"),
        extra=TORCHVISION,
    ),
    # Trains in worker processes (torch.multiprocessing) on a model in shared memory; one process
    # keeps the updates in a fixed order (two would race, and two runs of the same program differ).
    Case(
        "examples mnist_hogwild/main.py",
        "Hogwild training in a child process, shared-memory model, SGD",
        "pytorch+examples",
        ("mnist_hogwild/main.py", "mnist_hogwild/train.py"),
        args=("--num-processes", "1", "--epochs", "1", "--batch-size", "16", "--test-batch-size", "64"),
        extra=TORCHVISION,
        steps=1000,
    ),
    # Synthetic data by design (a random polynomial); plain gradient steps, no optimizer: runs to its end.
    Case(
        "examples regression/main.py",
        "polynomial regression, manual SGD, no optimizer",
        "pytorch+examples",
        ("regression/main.py",),
    ),
    # Patched copy (not counted among the unchanged scripts): CPU ranks need gloo and no device ids.
    Case(
        "examples ddp-tutorial-series/multigpu_torchrun.py",
        "DDP under torchrun (2 ranks, gloo), trainer class",
        "pytorch+examples",
        ("distributed/ddp-tutorial-series/multigpu_torchrun.py", "distributed/ddp-tutorial-series/datautils.py"),
        patches=(
            (
                "multigpu_torchrun.py",
                'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))',
                "pass  # (CPU: no device to select)",
            ),
            ("multigpu_torchrun.py", 'backend="nccl"', 'backend="gloo"'),
            ("multigpu_torchrun.py", "model.to(self.gpu_id)", 'model.to("cpu")'),
            ("multigpu_torchrun.py", "device_ids=[self.gpu_id]", "device_ids=None"),
            ("multigpu_torchrun.py", "source.to(self.gpu_id)", 'source.to("cpu")'),
            ("multigpu_torchrun.py", "targets.to(self.gpu_id)", 'targets.to("cpu")'),
            ("multigpu_torchrun.py", "MyTrainDataset(2048)", "MyTrainDataset(64)"),
        ),
        args=("5", "1", "--batch_size", "8"),
        nproc=2,
    ),
]


def make_data(case: Case, folder: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    if case.data == "nanogpt":
        d = folder / "data" / "openwebtext"
        d.mkdir(parents=True)
        for split in ("train", "val"):
            rng.integers(0, 50257, 4096, dtype=np.uint16).tofile(d / f"{split}.bin")
    elif case.data == "corpus":
        d = folder / "corpus"
        d.mkdir()
        words = [f"w{i}" for i in range(50)]
        for split, n in (("train", 400), ("valid", 80), ("test", 80)):
            lines = [" ".join(words[int(k)] for k in rng.integers(0, 50, 12)) for _ in range(n // 12 + 1)]
            (d / f"{split}.txt").write_text("\n".join(lines) + "\n")


def prepare(case: Case, src: Path, work: Path) -> Path:
    folder = work / case.name.split()[1].replace("/", "_").replace(".py", "")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for f in case.files:
        shutil.copy(src / case.repo / f, folder / os.path.basename(f))
    for name, old, new in case.patches:
        p = folder / name
        text = p.read_text()
        if old not in text:
            raise SystemExit(f"{case.name}: patch target not found in {name}: {old!r}")
        p.write_text(text.replace(old, new))
    for rel, text in case.extra.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    make_data(case, folder)
    return folder / case.script


def loss_drift(rows: list[dict]) -> dict:
    """The largest loss difference of a run as a fraction of the largest loss so far (what the AMP
    loss bounds measure), in the first 20 steps and after: the numbers those bounds were set from.
    A row carries |diff| and |diff|/|ref|, so |ref| is their ratio (unknown, and not needed, when
    the difference is 0)."""
    scale, early, late, n = 0.0, None, None, 0
    for r in rows:
        if not str(r.get("name", "")).startswith("loss[") or r.get("max_abs") is None:
            continue
        n += 1
        if r.get("max_rel"):
            scale = max(scale, r["max_abs"] / r["max_rel"])
        frac = r["max_abs"] / scale if scale else 0.0
        if (r.get("step") or 0) < 20:
            early = max(early or 0.0, frac)
        else:
            late = max(late or 0.0, frac)
    return {"loss_err_of_scale_first20": early, "loss_err_of_scale_after20": late, "losses": n}


def validate(script: Path, case: Case, unsafe: bool, timeout: int, steps: int | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torchopt",
        "validate",
        str(script),
        "--device",
        "cpu",
        "--json",
        "--steps",
        str(steps or case.steps),
        "--timeout",
        str(timeout),
        "--jobs",
        "2",
    ]
    cmd += ["--unsafe-fixes"] if unsafe else []
    cmd += ["--nproc", str(case.nproc)] if case.nproc > 1 else []
    cmd += ["--entry", case.entry] if case.entry else []
    cmd += ["--", *case.args] if case.args else []
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=script.parent)
    took = time.monotonic() - start
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = {"verdict": "error", "headline": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    culprits = [f"{c['code']}:{c['line']}" for c in (out.get("bisect") or {}).get("culprits", [])]
    return {
        "verdict": out.get("verdict"),
        "headline": out.get("headline"),
        "seconds": round(took, 1),
        "fixes": [f"{f['code']}:{f['line']}" for f in out.get("applied", [])],
        "culprits": culprits,
        "exit": proc.returncode,
        "steps": steps or case.steps,
        "tolerance": out.get("tolerance"),
        "notes": out.get("notes") or [],
        **loss_drift(out.get("rows") or []),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/tmp/realworld")
    ap.add_argument("--work", default="/tmp/validate-real")
    ap.add_argument("--only", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--mode", choices=("safe", "unsafe", "both"), default="both")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps for every case (default: per case)")
    ap.add_argument("--json-out", default="validate_real.json")
    a = ap.parse_args()
    results = []
    for case in CASES:
        if a.only and a.only not in case.name:
            continue
        script = prepare(case, Path(a.src), Path(a.work))
        for mode in ("safe", "unsafe"):
            if a.mode not in ("both", mode):
                continue
            r = validate(script, case, mode == "unsafe", a.timeout, a.steps)
            r.update(case=case.name, kind=case.kind, mode=mode, expected=case.expect[mode])
            r["right"] = r["verdict"] == r["expected"]
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print("| script | kind | fixes applied | verdict | exit | loss diff / loss scale | time (s) | right |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        counts = Counter(f.split(":")[0] for f in r["fixes"])
        fixes = ", ".join(c if n == 1 else f"{c} ×{n}" for c, n in counts.items()) or "none"
        verdict = r["headline"] if isinstance(r["headline"], str) else "nothing to validate"
        if r["culprits"]:
            verdict += f" (bisected to {', '.join(r['culprits'])})"
        drift = r.get("loss_err_of_scale_first20")
        drift_text = "—" if not drift else f"{drift:.2%}"
        if r.get("loss_err_of_scale_after20"):
            drift_text += f" ({r['loss_err_of_scale_after20']:.2%} after step 20)"
        print(
            f"| {r['case']} ({r['mode']}, {r['steps']} steps) | {r['kind']} | {fixes} | {verdict} | {r['exit']} | {drift_text} | "
            f"{r['seconds']} | {'yes' if r['right'] else 'NO'} |"
        )
    Path(a.json_out).write_text(json.dumps(results, indent=2))
    return 0 if all(r["right"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
