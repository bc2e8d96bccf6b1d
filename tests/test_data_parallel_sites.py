"""TOP401: when the file's DataParallel wraps cannot be converted, every wrap that trains is
reported, not only the one that refused the conversion (the others stay DataParallel too)."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

from torchopt.cli import app

TWO_BRANCHES = dedent("""\
    import torch
    import torch.nn as nn


    def main(args, model, loader):
        if args.arch.startswith("vgg"):
            model.features = nn.DataParallel(model.features)
            model.cuda()
        else:
            model = nn.DataParallel(model).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
""")


def test_every_data_parallel_wrap_is_reported_when_the_conversion_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "train.py"
    f.write_text(TWO_BRANCHES)
    res = CliRunner().invoke(app, ["check", str(f), "--select", "TOP401", "--no-cache", "--exit-zero"])
    lines = sorted(int(ln.split(":")[1]) for ln in res.output.splitlines() if "TOP401" in ln and ".py:" in ln)
    assert lines == [7, 10], res.output
    assert "converted together, and one is refused" in res.output


PROGRAM_REFUSAL = dedent("""\
    import torch
    import torch.nn as nn
    import torch.distributed as dist


    def main(args, model, loader):
        if args.rank != -1:
            dist.init_process_group("nccl")
            model = nn.parallel.DistributedDataParallel(model.cuda())
        elif args.wide:
            model = nn.DataParallel(model, device_ids=[0, 1])
        else:
            model = nn.DataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
""")


def test_a_refusal_for_the_whole_program_is_one_finding(tmp_path: Path) -> None:
    """The program already sets up a process group: the DataParallel wraps are its fallbacks, and the
    refusal is said once."""
    f = tmp_path / "train.py"
    f.write_text(PROGRAM_REFUSAL)
    res = CliRunner().invoke(app, ["check", str(f), "--select", "TOP401", "--no-cache", "--exit-zero"])
    assert sum("TOP401" in ln and ".py:" in ln for ln in res.output.splitlines()) == 1, res.output
