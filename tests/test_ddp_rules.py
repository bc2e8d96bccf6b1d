"""DDP rules (TOP401–TOP409) beyond their examples: opt-in selection, refusals, guard forms,
composition with the AMP rewrite. Pure source-to-source checks (fast)."""

from __future__ import annotations

import pytest

from torchopt.codemods.ddp.accumulation_without_no_sync import NoSyncAccumulation
from torchopt.codemods.ddp.data_parallel import DataParallelToDDP
from torchopt.codemods.ddp.unguarded_side_effect import RankZeroGuards
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

# The programs the rules' first examples hold: a DataParallel training script (TOP401), a DDP script
# printing and saving on every rank (TOP403), gradient accumulation without no_sync (TOP404).
DP_SRC = DataParallelToDDP.examples[0].src
GUARD_SRC = RankZeroGuards.examples[0].src
ACC_SRC = NoSyncAccumulation.examples[0].src
DDP_HEAD = (
    "import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n\n"
)


def _fix(src: str, *codes: str) -> str:
    return fix_source(src, Settings(select=codes), unsafe=True).text


def _diags(src: str, *codes: str):
    return check_source(src, Settings(select=codes)).diagnostics


@pytest.mark.parametrize(
    "select,enabled",
    [
        (("ALL",), False),
        (("TOP4",), False),
        (("ddp",), False),
        (("TOP402",), True),
        (("ALL", "TOP402"), True),
        (("single-process-to-ddp",), True),
        (("top402",), True),
    ],
)
def test_top402_is_opt_in(select, enabled):
    codes = Settings(select=select).enabled_codes()
    assert ("TOP402" in codes) is enabled
    if select != ("TOP402",) and select != ("single-process-to-ddp",) and select != ("top402",):
        assert "TOP401" in codes


def test_opt_in_still_honours_ignore():
    assert "TOP402" not in Settings(select=("ALL", "TOP402"), ignore=("TOP4",)).enabled_codes()


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda s: s.replace("nn.Linear(4, 2).to(device)", "nn.Linear(4, 2).to('cuda:1')"), "fixed device index"),
        (lambda s: s.replace("shuffle=True)", "sampler=my_sampler)"), "already has a sampler"),
        (lambda s: s.replace("nn.Linear(4, 2).to(device)", "nn.LazyLinear(2).to(device)"), "lazy module"),
        (lambda s: s.replace("DataLoader(train_ds,", "DataLoader(make_ds(),"), "bind the dataset"),
        (
            lambda s: s.replace(
                "nn.DataParallel(nn.Linear(4, 2).to(device))", "nn.DataParallel(nn.Linear(4, 2).to(device), dim=1)"
            ),
            "dim=",
        ),
        (
            lambda s: s.replace("for x, y in loader:", "for x, y in batches:"),
            "iterates no `DataLoader` this file builds",
        ),
    ],
)
def test_top401_refuses_with_a_reason(edit, reason):
    src = edit(DP_SRC)
    assert src != DP_SRC
    assert _fix(src, "TOP401") == src
    msgs = [d.message for d in _diags(src, "TOP401") if d.fix is None]
    assert msgs and reason in msgs[0], msgs


def test_sum_reduction_outside_training_does_not_block():
    src = DP_SRC + "with torch.no_grad():\n    total = nn.functional.mse_loss(model(x), y, reduction='sum')\n"
    assert "DistributedDataParallel(" in _fix(src, "TOP401")


def test_top401_note_has_launch_commands_and_eval_loaders():
    src = DP_SRC.replace(
        "loader = DataLoader(train_ds, batch_size=8, shuffle=True)\n",
        "loader = DataLoader(train_ds, batch_size=8, shuffle=True)\nval_loader = DataLoader(train_ds, batch_size=8)\n",
    )
    res = fix_source(src, Settings(select=("TOP401",)), unsafe=True)
    (d,) = [d for d in res.applied if d.code == "TOP401"]
    assert "semantics" in d.fix.tags
    note = d.fix.note
    assert "torchrun --standalone --nproc_per_node=N" in note and "--rdzv_backend=c10d" in note
    assert "per process" in note and "`val_loader` left alone" in note
    assert "val_sampler" not in res.text and "DataLoader(train_ds, batch_size=8)" in res.text


def test_top401_inside_main_uses_function_locals_and_dist_rank_elsewhere():
    src = (
        "import torch\nimport torch.nn as nn\nfrom torch.utils.data import DataLoader\n\n"
        "def log(msg):\n    print(msg)\n\n"
        "def main():\n    model = nn.DataParallel(nn.Linear(4, 2))\n"
        "    loader = DataLoader(ds, batch_size=4, shuffle=True)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for epoch in range(2):\n        for x, y in loader:\n"
        "            loss = (model(x) - y).pow(2).mean()\n            loss.backward()\n            opt.step()\n"
        "        print(epoch)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    out = _fix(src, "TOP401")
    main = out[out.index("def main():") :]
    assert main.index("setup_distributed()") < main.index("DistributedDataParallel(")
    assert "        if rank == 0:\n            print(epoch)" in out
    assert "def log(msg):\n    if dist.get_rank() == 0:\n        print(msg)" in out
    assert (
        "            opt.step()\n        if rank == 0:\n            print(epoch)\n    dist.destroy_process_group()\n"
        in out
    )
    assert _fix(out, "TOP4") == out


def test_top405_uses_the_tolerant_test_where_the_group_may_not_exist():
    src = (
        "import torch\nimport torch.distributed as dist\n\n"
        "def report(x):\n    print(x)\n\n"
        "if distributed:\n    dist.init_process_group('gloo')\nprint('start')\n"
    )
    out = _fix(src, "TOP405")
    assert "def report(x):\n    if not dist.is_initialized() or dist.get_rank() == 0:\n        print(x)" in out
    assert "if not dist.is_initialized() or dist.get_rank() == 0:\n    print('start')" in out
    assert _fix(out, "TOP405") == out


def test_top405_leaves_library_code_without_init_alone():
    src = (
        "import logging\nfrom torch.nn.parallel import DistributedDataParallel\n"
        "log = logging.getLogger(__name__)\n\nclass Task:\n    def __init__(self):\n        log.info('hi')\n"
    )
    assert not _diags(src, "TOP405")


def test_top405_does_not_guard_what_may_run_collectives():
    src = GUARD_SRC + "    print(evaluate(model))\n    dist.all_reduce(loss)\n"
    out = _fix(src, "TOP405")
    assert "    print(evaluate(model))\n" in out and "    dist.all_reduce(loss)\n" in out
    assert 'if dist.get_rank() == 0:\n        print(f"epoch' in out


def test_top404_refuses_a_condition_computed_by_the_step():
    src = ACC_SRC.replace("    if (i + 1) % 2 == 0:", "    n = i + 1\n    if n % 2 == 0:")
    src = src.replace("    loss = model(data[i])", "    n = i + 1\n    loss = model(data[i])", 1)
    out = _fix(src, "TOP404")
    assert "no_sync" not in out
    assert any("reads `n`" in d.message for d in _diags(src, "TOP404"))


def test_ddp_then_amp_then_no_sync_compose():
    src = open_fixture("ddp_accumulation")
    out = fix_source(src, Settings(select=("TOP4", "TOP2")), unsafe=True)
    codes = [d.code for d in out.applied]
    assert codes.index("TOP401") < codes.index("TOP202") < codes.index("TOP404")
    assert fix_source(out.text, Settings(select=("TOP4", "TOP2")), unsafe=True).text == out.text


def test_amp_on_data_parallel_without_the_conversion_is_float16_only():
    """DataParallel's replica threads autocast to CUDA's default float16: the default rewrite reaches
    them; a bfloat16 one would not, and is refused pointing at the conversion."""
    src = open_fixture("ddp_accumulation")
    assert [d.fix is not None for d in _diags(src, "TOP202")] == [True]
    bf16 = Settings(select=("TOP202",), rule_options={"TOP202": {"dtype": "bfloat16"}})
    msgs = [d.message for d in check_source(src, bf16).diagnostics if d.code == "TOP202"]
    assert any("TOP401" in m and "DataParallel" in m for m in msgs), msgs


def test_diagnostics_407_to_409():
    assert [d.code for d in _diags(DDP_HEAD + "m = DDP(net, find_unused_parameters=True)\n", "TOP407")] == ["TOP407"]
    sched = (
        DDP_HEAD + "m = DDP(net)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * 100)\n"
    )
    assert [d.code for d in _diags(sched, "TOP409")] == ["TOP409"]
    assert not _diags(sched.replace("EPOCHS * 100", "EPOCHS * len(loader)"), "TOP409")
    assert not _diags(sched.replace("m = DDP(net)\n", "m = net\n"), "TOP409")


def open_fixture(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parent.parent / "fixtures" / name / "before.py").read_text(encoding="utf-8")


def test_top401_under_a_main_guard_sets_up_inside_it():
    src = (
        "import torch\nimport torch.nn as nn\nfrom torch.utils.data import DataLoader\n\n"
        "def f():\n    print(1)\n\n\nif __name__ == '__main__':\n"
        "    model = nn.DataParallel(module=nn.Linear(2, 2))\n    loader = DataLoader(dataset=ds, batch_size=bs)\n"
        "    opt = torch.optim.SGD(model.parameters(), 0.1)\n    for epoch in range(3):\n"
        "        for x, y in loader:\n            model(x).sum().backward()\n            opt.step()\n"
        "        print(epoch)\n"
    )
    out = _fix(src, "TOP401")
    guard = out[out.index("if __name__") :]
    assert "    local_rank, rank, world_size = setup_distributed()\n" in guard
    assert guard.rstrip().endswith("    dist.destroy_process_group()")
    assert "def f():\n    if dist.get_rank() == 0:\n        print(1)" in out  # f may run outside the guard
    assert "        if rank == 0:\n            print(epoch)" in guard
    assert "DistributedSampler(ds, shuffle=False) if world_size > 1 else None" in guard
    assert _fix(out, "TOP4") == out


def test_data_parallel_without_a_module_is_refused_not_a_crash():
    src = DP_SRC + "other = nn.DataParallel()\n"
    assert any("without a module" in d.message for d in _diags(src, "TOP401"))


_SAVES = DDP_HEAD + (
    "import io\nimport os\n\n\n"
    "def copy_into(ema, state):\n"
    "    buf = io.BytesIO()\n    torch.save(state, buf)\n    buf.seek(0)\n    ema.load_state_dict(torch.load(buf))\n\n\n"
    "def checkpoint(state, filename='last.pt'):\n    torch.save(state, filename)\n\n\n"
    "def export(state, out):\n    torch.save(state, out)\n\n\n"
    "dist.init_process_group('gloo')\nmodel = DDP(nn.Linear(2, 2))\nema = nn.Linear(2, 2)\n"
    "copy_into(ema, model.module.state_dict())\n"
    "with open('w.pt', 'wb') as f:\n    torch.save(model.module.state_dict(), f)\n"
    "torch.save(model.module.state_dict(), os.path.join('runs', 'ckpt.pt'))\n"
)


def test_top405_guards_saves_into_files_not_into_buffers():
    """`torch.save` into an in-memory buffer that every process reads back is no file write: a rank-0
    guard there would leave the other ranks loading an empty buffer. A save into a path is guarded, a
    save into `f` of `with open(...)` is guarded with its block, and one into a value not known to be
    a path (a parameter without default) is left alone and said so."""
    out = _fix(_SAVES, "TOP405")
    assert "    buf = io.BytesIO()\n    torch.save(state, buf)\n" in out
    assert "    if not dist.is_initialized() or dist.get_rank() == 0:\n        torch.save(state, filename)" in out
    assert "def export(state, out):\n    torch.save(state, out)\n" in out
    assert "if dist.get_rank() == 0:\n    with open('w.pt', 'wb') as f:\n        torch.save(" in out
    assert "\n    torch.save(model.module.state_dict(), os.path.join(" in out  # module level, in the guard
    [diag] = _diags(_SAVES, "TOP405")
    assert diag.fix is not None and "`torch.save` writes to `out`, not known to be a file path" in diag.fix.note


_SAMPLER_ELSEWHERE = (
    "import torch\nimport torch.distributed as dist\nfrom torch.utils.data import DataLoader, TensorDataset\n"
    "from torch.utils.data.distributed import DistributedSampler\n\n\n"
    "def prepare_dataloaders(n):\n    ds = TensorDataset(torch.randn(n, 4), torch.randn(n, 1))\n"
    "    train_sampler = DistributedSampler(ds)\n"
    "    train_loader = DataLoader(ds, batch_size=4, sampler=train_sampler)\n    return train_loader, ds\n\n\n"
    "def train(epochs):\n    model = torch.nn.Linear(4, 1)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "    train_loader, ds = prepare_dataloaders(16)\n    for epoch in range(epochs):\n"
    "        for x, y in train_loader:\n            torch.nn.functional.mse_loss(model(x), y).backward()\n"
    "            opt.step()\n\n\n"
    "dist.init_process_group('gloo')\ntrain(2)\n"
)


def test_top403_writes_no_name_that_is_a_local_of_another_function():
    """The sampler is a local of `prepare_dataloaders()` and the epoch loop is in `train()`: writing
    `train_sampler.set_epoch(epoch)` there raises NameError on the first epoch. Reported, not fixed,
    and the message says where the sampler lives."""
    assert _fix(_SAMPLER_ELSEWHERE, "TOP403") == _SAMPLER_ELSEWHERE
    [diag] = _diags(_SAMPLER_ELSEWHERE, "TOP403")
    assert diag.fix is None and "`train_sampler` is a local of `prepare_dataloaders()`" in diag.message
    # the same loop with the loader and its sampler built beside it is fixed
    inline = _SAMPLER_ELSEWHERE.replace(
        "    train_loader, ds = prepare_dataloaders(16)\n",
        "    ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))\n    train_sampler = DistributedSampler(ds)\n"
        "    train_loader = DataLoader(ds, batch_size=4, sampler=train_sampler)\n",
    )
    inline = inline[: inline.index("def prepare_dataloaders")] + inline[inline.index("def train") :]
    assert "        train_sampler.set_epoch(epoch)" in _fix(inline, "TOP403")
