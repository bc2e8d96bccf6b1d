"""TOP501 (cuDNN auto-tuner) and TOP502 (TF32) only where the switch pays (torchopt/codemods/flags/pays.py):
a loop that repeats the forward, on shapes that do not change with every call, outside autocast.
Single files and small projects, checked through the CLI as a user runs it."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

import torchopt.cli


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dedent(text), encoding="utf-8")


def _check(tmp_path: Path, monkeypatch, target: str, codes: str = "TOP501,TOP502") -> str:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(torchopt.cli.app, ["check", target, "--no-cache", "--select", codes], catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output
    return r.output


# A vocoder-like project: the model is built in another module, the entry runs it once per file.
NETS = """\
    import torch.nn as nn


    class Vocoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose1d(80, 1, 16, stride=8)

        def forward(self, mel):
            return self.up(mel).tanh()
"""
AUDIO = """\
    import numpy as np
    import torch
    import torch.nn.functional as F


    def load_mel(path):
        mel = np.load(path)
        return torch.from_numpy(mel).float()


    def padded(mel):
        return F.pad(mel, (4, 4), mode="reflect")
"""
PER_FILE = """\
    import os
    import sys

    import numpy as np
    import torch
    from audio import load_mel, padded
    from nets import Vocoder


    def synthesise(folder):
        vocoder = Vocoder().to("cuda").eval()
        with torch.no_grad():
            for name in sorted(os.listdir(folder)):
                mel = padded(load_mel(os.path.join(folder, name))).cuda()
                wav = vocoder(mel.unsqueeze(0)).squeeze().cpu().numpy()
                np.save(os.path.join(folder, name + ".wav.npy"), wav)


    if __name__ == "__main__":
        synthesise(sys.argv[1])
"""


def test_one_call_per_file_of_its_own_length_gets_no_auto_tuner(tmp_path, monkeypatch):
    _write(tmp_path / "proj", {"infer.py": PER_FILE, "nets.py": NETS, "audio.py": AUDIO})
    out = _check(tmp_path, monkeypatch, "proj", "TOP501")
    assert "All checks passed" in out, out


def test_a_project_function_that_crops_makes_the_shapes_repeat(tmp_path, monkeypatch):
    cropping = AUDIO.replace("return torch.from_numpy(mel).float()", "return torch.from_numpy(mel[:, :400]).float()")
    _write(tmp_path / "proj", {"infer.py": PER_FILE, "nets.py": NETS, "audio.py": cropping})
    out = _check(tmp_path, monkeypatch, "proj", "TOP501")
    assert "infer.py:11:" in out and "TOP501 [unsafe fix]" in out and "`Vocoder()`, built in nets.py" in out, out


def test_one_call_per_file_through_an_unread_module_is_unknown_and_not_fixed(tmp_path, monkeypatch):
    # `torchopt check proj/infer.py`: audio.py is not part of the run, so what `padded` does is unknown
    single = PER_FILE.replace("from nets import Vocoder\n", "from torch import nn\n").replace(
        'Vocoder().to("cuda")', 'nn.ConvTranspose1d(80, 1, 16).to("cuda")'
    )
    _write(tmp_path / "proj", {"infer.py": single, "audio.py": AUDIO})
    out = _check(tmp_path, monkeypatch, "proj/infer.py", "TOP501")
    assert "proj/infer.py:13:9: TOP501 This program calls its convolutions once per file" in out, out
    assert "(what `padded` does to the input: `padded` comes from audio.py, which is not part of this run)" in " ".join(
        out.split()
    )
    assert "[unsafe fix]" not in out


def test_a_training_loop_beside_the_per_file_loop_still_gets_the_auto_tuner(tmp_path, monkeypatch):
    trains = PER_FILE.replace(
        "if __name__",
        """def train(steps):
        vocoder = Vocoder().cuda()
        opt = torch.optim.Adam(vocoder.parameters())
        for _ in range(steps):
            vocoder(torch.randn(8, 80, 32, device="cuda")).pow(2).mean().backward()
            opt.step()


    if __name__""",
    ).replace("synthesise(sys.argv[1])", "train(100)\n        synthesise(sys.argv[1])")
    _write(tmp_path / "proj", {"infer.py": trains, "nets.py": NETS, "audio.py": AUDIO})
    out = _check(tmp_path, monkeypatch, "proj", "TOP501")
    assert "TOP501 [unsafe fix]" in out, out


FLOPS = """\
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from nets import build


    def count(model, size):
        x = torch.ones(1, 3, size, size, device="cuda")
        with FlopCounterMode(display=False) as counter:
            model(x)
        return counter.get_total_flops()


    def main():
        for name in ("small", "large"):
            model = build(name).cuda().eval()
            retries = 2
            while retries:
                retries -= 1
                print(name, count(model, 224), sum(p.numel() for p in model.parameters()))


    if __name__ == "__main__":
        main()
"""
FLOP_NETS = """\
    import torch.nn as nn


    def build(name):
        width = 8 if name == "small" else 64
        return nn.Sequential(nn.Conv2d(3, width, 3), nn.Flatten(), nn.LazyLinear(10))
"""


def test_a_flop_counter_is_not_a_step_loop(tmp_path, monkeypatch):
    _write(tmp_path / "proj", {"flops.py": FLOPS, "nets.py": FLOP_NETS})
    out = _check(tmp_path, monkeypatch, "proj")
    assert "All checks passed" in out, out


def test_the_same_forward_outside_the_counter_is_a_step_loop(tmp_path, monkeypatch):
    timed = FLOPS.replace(
        "        return counter.get_total_flops()\n",
        "        for _ in range(100):\n            model(x)\n        return counter.get_total_flops()\n",
    )
    _write(tmp_path / "proj", {"flops.py": timed, "nets.py": FLOP_NETS})
    out = _check(tmp_path, monkeypatch, "proj")
    assert "TOP501 [unsafe fix]" in out and "TOP502 [unsafe fix]" in out, out


def test_a_model_handed_to_another_modules_loop_still_counts(tmp_path, monkeypatch):
    entry = """\
        import torch
        from nets import build
        from engine import fit


        if __name__ == "__main__":
            model = build("small").cuda()
            fit(model, torch.optim.SGD(model.parameters(), lr=0.1))
    """
    engine = """\
        import torch


        def fit(model, opt):
            for _ in range(100):
                model(torch.randn(8, 3, 32, 32, device="cuda")).sum().backward()
                opt.step()
    """
    _write(tmp_path / "proj", {"main.py": entry, "nets.py": FLOP_NETS, "engine.py": engine})
    out = _check(tmp_path, monkeypatch, "proj")
    assert "main.py:7:13: TOP501 [unsafe fix]" in out and "main.py:7:13: TOP502 [unsafe fix]" in out, out


AMP_STEP = """\
    import torch
    from torch import nn
    from precision import mixed


    def main():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler()
        for x in torch.randn(100, 8, 64, device="cuda"):
            with mixed():
                loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


    if __name__ == "__main__":
        main()
"""


def test_a_step_under_the_programs_own_autocast_gets_no_tf32(tmp_path, monkeypatch):
    precision = """\
        import torch


        def mixed(enabled=True):
            return torch.autocast("cuda", dtype=torch.float16, enabled=enabled)
    """
    _write(tmp_path / "proj", {"train.py": AMP_STEP, "precision.py": precision})
    out = _check(tmp_path, monkeypatch, "proj", "TOP502")
    assert "All checks passed" in out, out


def test_an_autocast_helper_that_cannot_be_read_is_unknown_and_not_fixed(tmp_path, monkeypatch):
    precision = """\
        import torch


        def mixed_autocast():
            return torch.autocast("cuda", dtype=torch.float16)
    """
    entry = AMP_STEP.replace("import mixed", "import mixed_autocast").replace("with mixed():", "with mixed_autocast():")
    _write(tmp_path / "proj", {"train.py": entry, "precision.py": precision})
    out = _check(tmp_path, monkeypatch, "proj/train.py", "TOP502")  # precision.py is not part of the run
    assert "proj/train.py:7:27: TOP502 float32 matmuls may run at full precision, but whether the step" in out, out
    assert (
        "`mixed_autocast` comes from precision.py, which is not part of this run" in " ".join(out.split())
        and "[unsafe fix]" not in out
    )
    assert "All checks passed" in _check(tmp_path, monkeypatch, "proj", "TOP502")  # the whole project: autocast


def test_an_autocast_for_the_cpu_leaves_cuda_matmuls_float32(tmp_path, monkeypatch):
    precision = """\
        import torch


        def mixed():
            return torch.autocast("cpu", dtype=torch.bfloat16)
    """
    _write(tmp_path / "proj", {"train.py": AMP_STEP, "precision.py": precision})
    out = _check(tmp_path, monkeypatch, "proj", "TOP502")
    assert "train.py:7:" in out and "TOP502 [unsafe fix]" in out, out


LOADER_ENTRY = """\
    import torch
    from torch import nn
    from data import make_loader


    def main():
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in make_loader("train"):
            nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
            opt.step()


    if __name__ == "__main__":
        main()
"""


def test_an_unread_loader_factory_is_no_unknown_convolution(tmp_path, monkeypatch):
    data = """\
        import torch


        def make_loader(split):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1)))
    """
    _write(tmp_path / "proj", {"main.py": LOADER_ENTRY, "data.py": data})
    out = _check(tmp_path, monkeypatch, "proj/main.py", "TOP501")  # data.py is not part of the run
    assert "All checks passed" in out, out


def test_an_unread_model_factory_is_still_an_unknown_convolution(tmp_path, monkeypatch):
    entry = LOADER_ENTRY.replace("from data import make_loader", "from data import make_loader, make_model").replace(
        "nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()", "make_model().cuda()"
    )
    _write(tmp_path / "proj", {"main.py": entry, "data.py": "def make_model(): ...\ndef make_loader(s): ...\n"})
    out = _check(tmp_path, monkeypatch, "proj/main.py", "TOP501")
    assert "main.py:7:13: TOP501 Whether this program builds convolutions" in out, out
    assert "`make_model` comes from data.py, which is not part of this run" in out, out


def test_a_module_of_the_file_called_once_per_image_file_of_its_own_size(tmp_path, monkeypatch):
    src = """\
        import glob

        import torch
        from PIL import Image
        from torch import nn
        from torchvision.transforms.functional import to_tensor


        class Upscaler(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Conv2d(3, 12, 3, padding=1)
                self.shuffle = nn.PixelShuffle(2)

            def forward(self, x):
                return self.shuffle(self.body(x))


        if __name__ == "__main__":
            up = Upscaler().cuda().eval()
            with torch.inference_mode():
                for path in glob.glob("photos/*.png"):
                    image = to_tensor(Image.open(path).convert("RGB"))
                    torch.save(up(image.unsqueeze(0).cuda()).cpu(), path + ".pt")
    """
    _write(tmp_path, {"upscale.py": src})
    assert "All checks passed" in _check(tmp_path, monkeypatch, "upscale.py", "TOP501")
    resized = src.replace('.convert("RGB"))', '.convert("RGB").resize((256, 256)))')
    _write(tmp_path, {"upscale.py": resized})
    assert "upscale.py:12:21: TOP501 [unsafe fix]" in _check(tmp_path, monkeypatch, "upscale.py", "TOP501")


def test_a_loop_over_a_compiled_callable_is_a_step_loop(tmp_path, monkeypatch):
    src = """\
        import torch
        import torch.nn.functional as F

        if __name__ == "__main__":
            weight = torch.randn(8, 3, 3, 3, device="cuda")
            step = torch.compile(lambda x: F.conv2d(x, weight).relu())
            for _ in range(100):
                step(torch.randn(4, 3, 32, 32, device="cuda"))
    """
    _write(tmp_path, {"bench.py": src})
    out = _check(tmp_path, monkeypatch, "bench.py", "TOP501")
    assert "bench.py:6:36: TOP501 [unsafe fix]" in out, out
