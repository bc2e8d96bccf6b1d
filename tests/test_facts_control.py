"""Control facts (torchopt/analysis/control.py): which guards a statement runs under, read from the
program's own conditions and options, and the findings they rule out on small programs."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import MetadataWrapper

from torchopt.analysis.control import Guard, control_of
from torchopt.analysis.syntax import walk
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source
from torchopt.rewrite.rule import Rule, RuleContext


class _Probe(Rule):
    code = "TOP000"
    name = "probe"


def _rule(src: str) -> tuple[_Probe, cst.Module]:
    wrapper = MetadataWrapper(cst.parse_module(src), unsafe_skip_copy=True)
    rule = _Probe(RuleContext(wrapper.module, {}, ()))
    rule.resolving = rule.resolve(wrapper)  # kept alive: closing it drops the metadata
    rule.resolving.__enter__()
    return rule, wrapper.module


def _call(module: cst.Module, name: str) -> cst.Call:
    return next(
        n
        for n in walk(module, True)
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == name
    )


def _codes(src: str, select: str) -> list[tuple[int, str]]:
    return [(d.line, d.code) for d in check_source(src, Settings(select=(select,))).diagnostics]


OPTIONS = """\
import argparse
from dataclasses import dataclass

import torch


@dataclass
class Args:
    target_kl: float = None
    norm_adv: bool = True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", default=None, type=int)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--save-val-results", action="store_true", dest="save_val")
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--no-amp", action="store_false", dest="amp")
    args = parser.parse_args()
    cfg = Args()
    if args.seed is not None:
        seeded()
    else:
        unseeded()
    if args.augment:
        augmented()
    if args.save_val:
        saved()
    if args.lr:
        with_lr()
    if args.amp:
        with_amp()
    if cfg.target_kl is not None and late(cfg.target_kl):
        pass
    if cfg.norm_adv:
        normed()
    if not args.augment:
        plain()
    else:
        augmented_too()
"""


def test_an_option_off_by_default_guards_its_code():
    rule, module = _rule(OPTIONS)
    control = control_of(rule)
    off = Guard.OPT_IN | Guard.OFF_BY_DEFAULT
    for name in ("seeded", "augmented", "saved", "late", "augmented_too"):
        assert control.guards(_call(module, name)).flags == off, name
    assert control.guards(_call(module, "seeded")).switch == "args.seed"
    assert "`args.seed` (off by default)" in control.guards(_call(module, "seeded")).why
    # on by default, or the default path of a switch: the code runs in a plain run
    for name in ("with_lr", "with_amp", "normed"):
        assert Guard.OFF_BY_DEFAULT not in control.guards(_call(module, name)), name
    for name in ("unseeded", "plain"):
        assert control.guards(_call(module, name)).flags == Guard.NONE, name


def test_an_upper_case_rank_in_a_set_is_a_rank_guard():
    src = dedent("""\
        import os
        import torch

        RANK = int(os.getenv("RANK", -1))

        def train(model, loader, opt):
            for x, y in loader:
                model(x).sum().backward()
                if RANK in {-1, 0}:
                    main_only()
                if RANK != -1 and LOCAL_RANK == 0:
                    pass
    """)
    rule, module = _rule(src)
    assert control_of(rule).guards(_call(module, "main_only")).flags == Guard.RANK0


def test_prints_rank_aware_when_the_program_replaces_builtins_print():
    src = dedent("""\
        import builtins

        def main_worker(gpu, args):
            args.gpu = gpu
            if args.multiprocessing_distributed and args.gpu != 0:
                def print_pass(*args):
                    pass
                builtins.print = print_pass
    """)
    rule, _ = _rule(src)
    assert control_of(rule).prints_rank_aware()
    rule, _ = _rule("import builtins\n\nprint(builtins.len([]))\nargs.x = 1\n")
    assert not control_of(rule).prints_rank_aware()


DDP = """\
import os
import builtins
import torch
import torch.distributed as dist

RANK = int(os.getenv("RANK", -1))


def main(model, loader, opt):
    dist.init_process_group("nccl")
{extra}    for epoch in range(10):
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
        if RANK in {{-1, 0}}:
            torch.save(model.state_dict(), f"epoch{{epoch}}.pt")
        print("=> epoch done")
"""


def test_side_effects_already_on_rank_0_are_not_guarded_again():
    # the save is under `RANK in {-1, 0}`; the print is reported (every rank prints)
    assert _codes(DDP.format(extra=""), "TOP405") == [(17, "TOP405")]
    silenced = "    if RANK > 0:\n        builtins.print = lambda *a, **k: None\n"
    assert _codes(DDP.format(extra=silenced), "TOP405") == []


SEEDED = """\
import argparse
import torch
import torch.backends.cudnn as cudnn

parser = argparse.ArgumentParser()
parser.add_argument("--seed", default={default}, type=int)
args = parser.parse_args()
if args.seed is not None:
    torch.manual_seed(args.seed)
    cudnn.deterministic = True
"""


def test_a_determinism_switch_under_an_opt_in_seed_is_not_reported():
    assert _codes(SEEDED.format(default="None"), "TOP503") == []
    assert _codes(SEEDED.format(default="0"), "TOP503") == [(10, "TOP503")]


HOST_READ = """\
import argparse
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--save-val-results", action="store_true", default={default})
opts = parser.parse_args()


def validate(model, loader):
    for x, y in loader:
        out = model(x.cuda())
        if opts.save_val_results:
            save_png(out.cpu().numpy())
"""


def test_a_host_read_under_an_option_off_by_default_is_not_reported():
    assert _codes(HOST_READ.format(default="False"), "TOP601") == []
    assert [c for _, c in _codes(HOST_READ.format(default="True"), "TOP601")] == ["TOP601"]


SAVE_JSON = """\
import argparse
import torch

def save_one(pred, out):
    out.append(pred.tolist())

def run(model, loader, save_json=False):
    out = []
    for x in loader:
        pred = model(x)
        if save_json:
            save_one(pred, out)
    return out

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-json", action="store_true")
    opt = parser.parse_args()
    model, loader = torch.nn.Linear(2, 2).cuda(), [torch.ones(2).cuda()]
    {call}

if __name__ == "__main__":
    main()
"""


def test_a_parameter_off_by_default_guards_its_code():
    """`def run(..., save_json=False)`: off in the program's default run when no call of the file
    turns it on; the guard carries into a helper every call of which it holds."""
    for call in (
        "run(model, loader)",
        "run(model, loader, save_json=False)",
        "run(**vars(opt))",
        "run(model, loader, opt.save_json)",
    ):
        assert _codes(SAVE_JSON.format(call=call), "TOP601") == [], call
    rule, module = _rule(SAVE_JSON.format(call="run(model, loader)"))
    guards = control_of(rule).guards(_call(module, "save_one"))
    assert guards.flags == Guard.OPT_IN | Guard.OFF_BY_DEFAULT
    assert guards.why == "it runs only when the parameter `save_json` (off by default) is set"
    # passed on, passed something else, spread from a list, handed on as a value, or never called
    for call in (
        "run(model, loader, True)",
        "run(model, loader, save_json=opt.cuda)",
        "run(*[model, loader, True])",
        "opt.save_json = True\n    run(**vars(opt))",
        "hooks = [run]",
        "pass",
    ):
        assert [c for _, c in _codes(SAVE_JSON.format(call=call), "TOP601")] == ["TOP601"], call
    # a helper also called without the guard is not guarded by it
    also = SAVE_JSON.format(call="run(model, loader)").replace(
        "    return out\n", "        save_one(pred, out)\n    return out\n"
    )
    assert [c for _, c in _codes(also, "TOP601")] == ["TOP601"]


FIRE = """\
import fire
import torch

def main(profile: bool = False):
    model, loader = torch.nn.Linear(2, 2).cuda(), [torch.ones(2).cuda()]
    for x in loader:
        y = model(x)
        if profile:
            print(y.sum().item())

if __name__ == "__main__":
    {run}
"""


def test_a_function_run_from_the_command_line_keeps_its_defaults():
    assert _codes(FIRE.format(run="fire.Fire(main)"), "TOP601") == []
    assert [c for _, c in _codes(FIRE.format(run="main(profile=True)"), "TOP601")] == ["TOP601"]
    assert [c for _, c in _codes(FIRE.format(run="print(main)"), "TOP601")] == ["TOP601"]


# ------------------------------------------------------------------ programs that run no step

MODEL = """\
import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, z):
        return self.fc(z)
"""

CONVERT = """\
import numpy as np
import torch

from model import Generator

if __name__ == "__main__":
    device = "cuda"
    g = Generator().to(device)
    g.load_state_dict(torch.load("g.pt"))
    z = np.random.randn(2, 4).astype("float32")
    with torch.no_grad():
        out = g(torch.from_numpy(z).to(device))
    ref = torch.from_numpy(np.load("ref.npy")).to(device)
{extra}    print((out - ref).abs().max())
"""


def _project_codes(tmp_path, files: dict[str, str], main: str, select: tuple[str, ...]) -> list[tuple[int, str]]:
    from torchopt.rewrite.projectscope import ProjectScope, in_scope

    for rel, text in files.items():
        (tmp_path / rel).write_text(text, encoding="utf-8")
    path = tmp_path / main
    with in_scope(ProjectScope(folders=[str(tmp_path)])):
        found = check_source(path.read_text(encoding="utf-8"), Settings(select=select), str(path))
    return [(d.line, d.code) for d in found.diagnostics]


def test_a_converter_that_runs_no_step_is_told_nothing_about_per_step_costs(tmp_path):
    files = {"model.py": MODEL, "convert.py": CONVERT.format(extra="")}
    assert _project_codes(tmp_path, files, "convert.py", ("TOP101", "TOP802")) == []
    # a loop that calls the generator is steady work: the same lines are reported
    loop = "    for _ in range(100):\n        out = g(ref)\n"
    files["convert.py"] = CONVERT.format(extra=loop)
    assert _project_codes(tmp_path, files, "convert.py", ("TOP101", "TOP802")) == [
        (11, "TOP802"),
        (12, "TOP101"),
        (13, "TOP101"),
    ]


def test_a_converter_that_calls_a_training_function_of_the_project_is_no_one_off(tmp_path):
    engine = "def fit(model):\n    for x in range(3):\n        model(x).sum().backward()\n"
    files = {
        "model.py": MODEL,
        "engine.py": engine,
        "convert.py": "from engine import fit\n" + CONVERT.format(extra="    fit(g)\n"),
    }
    # (TOP802 is for inference-only programs: this one trains)
    assert [c for _, c in _project_codes(tmp_path, files, "convert.py", ("TOP101", "TOP802"))] == ["TOP101", "TOP101"]


PACK = """\
import h5py
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm


def main():
    loader = DataLoader(torch.load("images.pt"), batch_size=64, num_workers=8)
    with h5py.File("out.hdf5", "w") as f:
        for i, (x, y) in enumerate(tqdm(loader)):
            x = (255 * x).byte().numpy()
            f["imgs"].resize(f["imgs"].shape[0] + x.shape[0], axis=0)
{work}

if __name__ == "__main__":
    main()
"""


def test_a_data_packing_script_gets_no_cpu_launcher_advice(tmp_path):
    assert _project_codes(tmp_path, {"pack.py": PACK.format(work="")}, "pack.py", ("TOP951",)) == []
    work = "            total = x.sum() if i else torch.zeros(1)\n"
    assert _project_codes(tmp_path, {"pack.py": PACK.format(work=work)}, "pack.py", ("TOP951",)) == [(16, "TOP951")]


BACKBONE = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for block in self.blocks:
            x = self.fc(block(x))
        return x


if __name__ == "__main__":
    model = Net()
    if torch.cuda.is_available():
        torch.backends.cudnn.deterministic = True
{run}"""


def test_a_model_files_shape_check_runs_once(tmp_path):
    once = "    print(model(torch.ones(1, 4)).shape)\n"
    assert _project_codes(tmp_path, {"net.py": BACKBONE.format(run=once)}, "net.py", ("TOP503",)) == []
    steady = "    for _ in range(1000):\n        model(torch.ones(1, 4))\n"
    assert _project_codes(tmp_path, {"net.py": BACKBONE.format(run=steady)}, "net.py", ("TOP503",)) == [(20, "TOP503")]
