"""More findings that real scripts showed to be false: CPU launcher advice on GPU scripts, vocabulary
padding on a vocabulary that is already padded, profilers in tests and benchmarks; and the wording of
the persistent-workers message. Each script is a reduced copy of the pattern the real one has; every
run goes through the command line on a tree under tmp_path, whose files must stay byte-identical."""

from __future__ import annotations

import hashlib
from pathlib import Path
from textwrap import dedent

import pytest
from typer.testing import CliRunner

from torchopt.cli import app


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _check(tmp_path: Path, files: dict[str, str], code: str) -> tuple[int, str]:
    """Run `torchopt check` on a fresh tree under tmp_path; the tree must come out unchanged."""
    root = tmp_path / "proj"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    outside = _hashes(tmp_path)
    res = CliRunner().invoke(app, ["check", str(root), "--select", code, "--no-cache", "--output-format", "text"])
    assert _hashes(tmp_path) == outside
    for name, text in files.items():
        assert (root / name).read_bytes() == text.encode()
    return res.exit_code, res.output


# ----------------------------------------------------------------------------- CPU launcher advice

MAIN = '\n\nif __name__ == "__main__":\n    main()\n'

ACCELERATOR = (
    dedent("""\
    import argparse
    import torch


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--no-accel", action="store_true")
        args = parser.parse_args()
        use_accel = not args.no_accel and torch.accelerator.is_available()
        if use_accel:
            device = torch.accelerator.current_accelerator()
        else:
            device = torch.device("cpu")
        model = torch.nn.Linear(4, 2).to(device)
        state = torch.load("ckpt.pt", map_location="cpu")
    """)
    + MAIN
)

CUDA_FALLBACK = (
    dedent("""\
    import torch


    def main():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = torch.nn.Linear(4, 2).to(device)
        print(model(torch.ones(1, 4, device=device)).cpu())
    """)
    + MAIN
)

DEVICE_FLAG_CUDA = (
    dedent("""\
    import argparse
    import torch


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--device", default="cuda", help="device to use for training / testing")
        args = parser.parse_args()
        device = torch.device(args.device)
        checkpoint = torch.load(args.resume, map_location="cpu")
    """)
    + MAIN
)

HELPER_DEVICE = (
    dedent("""\
    import torch as th

    from guided import dist_util


    def main():
        dist_util.setup_dist()
        model = build()
        model.load_state_dict(dist_util.load_state_dict("m.pt", map_location="cpu"))
        model.to(dist_util.dev())
        noise = th.randn(4, 3, device=dist_util.dev())
    """)
    + MAIN
)

TRAINER = (
    dedent("""\
    import torch
    import lightning as L


    def main():
        model = torch.load("init.pt", map_location="cpu")
        L.Trainer(max_epochs=3).fit(model)
    """)
    + MAIN
)


@pytest.mark.parametrize(
    "script",
    [ACCELERATOR, CUDA_FALLBACK, DEVICE_FLAG_CUDA, HELPER_DEVICE, TRAINER],
    ids=["torch-accelerator", "cuda-else-cpu", "device-flag-cuda", "helper-device", "trainer"],
)
def test_gpu_scripts_with_a_cpu_fallback_get_no_cpu_launcher_advice(tmp_path: Path, script: str) -> None:
    """Before, any "cpu" string (a fallback branch, `map_location="cpu"`) made the script a CPU one."""
    rc, out = _check(tmp_path, {"train.py": script}, "TOP951")
    assert rc == 0 and "TOP951" not in out, out


CPU_FLAG = (
    dedent("""\
    import argparse
    import torch


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--device", default="cpu", help="cpu, or cuda when you have one")
        args = parser.parse_args()
        x = torch.ones(2, device=args.device)
        for _ in range(100):  # steady work: a one-off script would not be told about threads at all
            x = torch.sin(x)
    """)
    + MAIN
)

CPU_ONLY = (
    dedent("""\
    import torch


    def main():
        device = torch.device("cpu")
        model = torch.nn.Linear(4, 2).to(device)
        for _ in range(100):
            print(model(torch.ones(1, 4)))
    """)
    + MAIN
)


@pytest.mark.parametrize(
    "script, why",
    [
        (CPU_FLAG, 'its device option defaults to "cpu" (line 7)'),
        (CPU_ONLY, 'it places its tensors on "cpu" (line 6) and never selects an accelerator'),
    ],
    ids=["cpu-flag", "cpu-only"],
)
def test_cpu_scripts_are_told_why(tmp_path: Path, script: str, why: str) -> None:
    rc, out = _check(tmp_path, {"train.py": script}, "TOP951")
    assert rc == 1
    (line,) = [ln for ln in out.splitlines() if "TOP951" in ln and "runs on the CPU" in ln]
    assert line.startswith(str(tmp_path / "proj" / "train.py")) and f"runs on the CPU ({why})" in line


# ----------------------------------------------------------------------------- vocabulary padding

NANOGPT_CONFIG = dedent("""\
    from dataclasses import dataclass

    import torch.nn as nn


    @dataclass
    class GPTConfig:
        block_size: int = 1024
        vocab_size: int = 50304  # GPT-2's 50257 rounded up
        n_embd: int = 768


    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        def forward(self, idx):
            return self.lm_head(self.wte(idx))
    """)

META_FALLBACK = dedent("""\
    import torch.nn as nn

    meta_vocab_size = read_meta()
    VOCAB = meta_vocab_size or 50304


    class LM(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, d)
            self.head = nn.Linear(d, VOCAB)

        def forward(self, idx):
            return self.head(self.tok(idx))
    """)

PARAM_DEFAULT = META_FALLBACK.replace("meta_vocab_size = read_meta()\nVOCAB = meta_vocab_size or 50304\n", "").replace(
    "def __init__(self, d):", "def __init__(self, d, VOCAB=50304):"
)


@pytest.mark.parametrize(
    "script",
    [NANOGPT_CONFIG, META_FALLBACK, PARAM_DEFAULT],
    ids=["dataclass-field", "or-fallback", "parameter-default"],
)
def test_vocabulary_whose_default_is_padded_is_left_alone(tmp_path: Path, script: str) -> None:
    """Before, 50304 was reported as "not a multiple of 8"; beside it, a 50257 default and a computed
    size are still reported."""
    unpadded = NANOGPT_CONFIG.replace("50304  # GPT-2's 50257 rounded up", "50257")
    computed = META_FALLBACK.replace("VOCAB = meta_vocab_size or 50304", "VOCAB = len(tokenizer)")
    rc, out = _check(tmp_path, {"model.py": script, "gpt2.py": unpadded, "tok.py": computed}, "TOP301")
    reported = sorted(Path(ln.split(":")[0]).name for ln in out.splitlines() if " TOP301 " in ln)
    assert rc == 1 and reported == ["gpt2.py", "tok.py"], out
    assert "vocabulary size `config.vocab_size` is not a multiple of 8" in out
    assert "vocabulary size `VOCAB` is not a multiple of 8" in out


# ----------------------------------------------------------------------------- profilers on purpose

PROFILED_TRAINING = dedent("""\
    import torch


    def {name}(model, loader, opt):
        with torch.profiler.profile():
            for x, y in loader:
                (model(x) - y).pow(2).mean().backward()
                opt.step()
    """)


@pytest.mark.parametrize("name", ["test_training_step_profile", "benchmark_training", "bench_step"])
def test_profiler_in_a_test_or_benchmark_function_is_left_alone(tmp_path: Path, name: str) -> None:
    """Before, a test or benchmark that profiles on purpose was told to gate its profiler; the same
    profiler in training code (train.py) is still reported."""
    files = {"perf.py": PROFILED_TRAINING.format(name=name), "train.py": PROFILED_TRAINING.format(name="train")}
    rc, out = _check(tmp_path, files, "TOP812")
    lines = [ln for ln in out.splitlines() if " TOP812 " in ln]
    assert rc == 1 and len(lines) == 1 and "train.py:5:" in lines[0], out
    assert "profiles the whole training loop" in lines[0]


@pytest.mark.parametrize("filename", ["test_profile.py", "profile_test.py", "tests/test_train.py"])
def test_profiler_in_a_test_file_is_left_alone(tmp_path: Path, filename: str) -> None:
    files = {filename: PROFILED_TRAINING.format(name="run"), "train.py": PROFILED_TRAINING.format(name="run")}
    rc, out = _check(tmp_path, files, "TOP812")
    lines = [ln for ln in out.splitlines() if " TOP812 " in ln]
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(str(tmp_path / "proj" / "train.py")), out


# ----------------------------------------------------------------------------- persistent workers message

WORKERS = dedent("""\
    from torch.utils.data import DataLoader


    def main(ds, model, opt, workers):
        loader = DataLoader(ds, batch_size=4, num_workers={n})
        for epoch in range(3):
            for x, y in loader:
                model(x).sum().backward()
                opt.step()
    """)


def test_transient_workers_message_reads_correctly(tmp_path: Path) -> None:
    """Before, a worker count given by a variable read "its worker worker processes"."""
    files = {"a.py": WORKERS.format(n="4"), "b.py": WORKERS.format(n="workers")}
    rc, out = _check(tmp_path, files, "TOP703")
    assert rc == 1 and "worker worker" not in out, out
    assert "`DataLoader(...)` starts and stops its 4 worker processes every epoch" in out
    assert "`DataLoader(...)` starts and stops its worker processes every epoch" in out
