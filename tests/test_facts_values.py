"""The value and control facts the sync family asks (torchopt/analysis/placement.py, control.py):
findings the facts rule out on small programs of the shapes real scripts use, and the TOP601 fix
that must not write a device the program did not choose."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper

from semantic import compare_programs
from torchopt.analysis.control import Guard, Rate, control_of
from torchopt.analysis.names import dotted
from torchopt.analysis.placement import Kind, Where, placements
from torchopt.analysis.syntax import walk
from torchopt.rewrite.rule import Rule, RuleContext
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

S = Settings(select=("TOP6",))

STEP = """\
import torch

def train(model, loader, opt, crit):
    for x, y in loader:
        out = model(x)
        loss = crit(out, y)
        loss.backward()
        opt.step()
"""


def codes(src: str) -> list[tuple[int, str]]:
    return [(d.line, d.code) for d in check_source(src, S).diagnostics]


def in_step(body: str, header: str = "") -> str:
    """``body`` (8-space indented lines) appended to the step of a training loop."""
    return header + STEP + dedent(body).replace("\n", "\n        ").join(["        ", "\n"])


# ------------------------------------------------------------------ value facts


@pytest.mark.parametrize(
    "body",
    [
        # a tensor moved with .cpu(), then read: the sync is the .cpu() (TOP603), not the .tolist()
        "preds = out.argmax(1).cpu()\nlabels = preds.tolist()",
        # a list built from a CPU tensor, and an element of it
        "scores = out.detach().cpu()\nrows = [float(s) for s in scores]\nbest = int(scores[0])",
        # a tensor made on the CPU without a device
        "noise = torch.rand(3)\nprint(noise.tolist())",
    ],
)
def test_no_host_read_of_host_values(body):
    found = codes(in_step(body))
    assert [c for _, c in found if c != "TOP603"] == [], found


def test_the_cpu_copy_is_reported_where_it_waits_and_a_device_read_stays_reported():
    assert codes(in_step("preds = out.argmax(1).cpu()\nlabels = preds.tolist()")) == [(9, "TOP603")]
    assert codes(in_step("labels = out.argmax(1).tolist()")) == [(9, "TOP601")]
    # a copy in the same expression as the read: reported once, at the read (TOP603 leaves it)
    assert codes(in_step("labels = out.detach().cpu().numpy().tolist()")) == [(9, "TOP601")]


def test_a_rebinding_replaces_the_fact_only_where_it_surely_runs():
    straight = in_step("vals = out.detach()\nvals = vals.cpu()\nprint(vals.tolist())")
    assert codes(straight) == [(10, "TOP603")]
    one_path = in_step("vals = out.detach()\nif loss > 0:\n    vals = vals.cpu()\nprint(vals.tolist())")
    assert (12, "TOP601") in codes(one_path)
    as_list = in_step("vals = out.detach().cpu()\nvals = vals.tolist()\nfor v in vals:\n    print(float(v))")
    assert codes(as_list) == [(9, "TOP603")]


def test_an_fstring_of_a_str_path_is_no_tensor():
    src = dedent("""\
        import torch

        def train(model, loader, opt, crit, out_dir):
            paths = [f"{out_dir}/{i}.png" for i in range(100)]
            for path, (x, y) in zip(paths, loader):
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                print(f"saved {path}")
    """)
    assert codes(src) == []


def test_counters_from_itertools_count_and_enumerate_are_ints():
    src = dedent("""\
        import itertools
        import torch

        def train(model, loader, opt, crit):
            for step, (x, y) in zip(itertools.count(), loader):
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                print(f"step {step}")
                if step > 100:
                    break
            for i, (x, y) in enumerate(loader):
                model(x).sum().backward()
                print(f"batch {i}", float(i))
    """)
    assert codes(src) == []


# ------------------------------------------------------------------ control facts


GUARDED = """\
import torch
import torch.distributed as dist

def train(model, loader, opt, crit, args, rank, local_rank, accelerator, log_every, sample_every):
    step = 0
    for i, (x, y) in enumerate(loader):
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        if {test}:
            torch.cuda.synchronize()
            print(loss.item(), loss)
            v = loss.cpu()
"""


@pytest.mark.parametrize(
    "test",
    [
        "step % log_every == 0",
        "step % sample_every == 0 and rank == 0",
        "i == 0",
        "i < 1",
        "torch.cuda.is_available()",
        "not torch.cuda.is_available()",
        "args.gpu",
        "not args.no_cuda",
        "device == 'cpu'",
    ],
)
def test_no_per_step_finding_under_a_rare_or_guarded_branch(test):
    """The same reads under a test of no known shape (`if flag:`) are reported: the guard is read.
    An explicit sync on the accelerator path of a device check still runs every step there."""
    src = GUARDED.format(test=test)
    accelerator_path = test in ("torch.cuda.is_available()", "args.gpu", "not args.no_cuda")
    assert codes(src) == ([(12, "TOP606")] if accelerator_path else [])
    unguarded = src.replace(f"if {test}:", "if log_every > 2:")
    assert sorted(c for _, c in codes(unguarded)) == ["TOP601", "TOP602", "TOP603", "TOP606"]


@pytest.mark.parametrize(
    "test",
    ["rank == 0", "local_rank in (-1, 0)", "is_main_process()", "dist.get_rank() == 0", "accelerator.is_main_process"],
)
def test_per_step_waits_on_rank_0_only_are_reported(test):
    """Rank 0 waits at every step and the other ranks wait for it at the next collective."""
    src = GUARDED.format(test=test)
    assert sorted(c for _, c in codes(src)) == ["TOP601", "TOP602", "TOP603", "TOP606"]
    periodic = src.replace(f"if {test}:", f"if step % log_every == 0 and {test}:")
    assert codes(periodic) == []


def test_a_logger_that_returns_early_off_rank_0_but_not_a_rank_guard_around_the_loop():
    src = dedent("""\
        import torch
        import torch.distributed as dist

        def log_value(value):
            if dist.get_rank() != 0:
                return
            print(value.item())

        def train(model, loader, opt, crit):
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                log_value(loss)
    """)
    assert [c for _, c in codes(src)] == ["TOP601"]
    periodic = src.replace("        log_value(loss)", "        if step % 10 == 0:\n            log_value(loss)")
    periodic = periodic.replace("for x, y in loader:", "for step, (x, y) in enumerate(loader):")
    assert codes(periodic) == []
    evaluation = dedent("""\
        import torch

        def evaluate(model, loader, rank):
            correct = 0
            if rank == 0:
                for x, y in loader:
                    correct += (model(x).argmax(1) == y).sum().item()
            return correct
    """)
    assert [c for _, c in codes(evaluation)] == ["TOP601"]


def test_a_logger_that_returns_early_unless_it_is_a_log_step():
    """`if step % every != 0: return` (or `if not should_log: return`) at the top of a helper: what
    follows runs every few steps. An early return on a test of no known shape leaves it every step."""
    src = dedent("""\
        import torch

        class Metrics:
            def __init__(self, every):
                self.every = every

            def log(self, step, loss):
                if step % self.every != 0:
                    return
                print(loss.item())

        def train(model, loader, opt):
            metrics = Metrics(10)
            for step, x in enumerate(loader):
                loss = model(x).sum()
                loss.backward()
                opt.step()
                metrics.log(step, loss)
    """)
    assert codes(src) == []
    flag = src.replace("if step % self.every != 0:", "should_log = step % self.every == 0\n        if not should_log:")
    assert codes(flag) == []
    assert codes(src.replace("if step % self.every != 0:", "if step % self.every:")) == []
    unknown = src.replace("if step % self.every != 0:", "if step < self.every:")
    assert [c for _, c in codes(unknown)] == ["TOP601"]
    late = src.replace(
        "if step % self.every != 0:\n            return\n        print(loss.item())",
        "print(loss.item())\n        if step % self.every != 0:\n            return",
    )
    assert late != src
    assert [c for _, c in codes(late)] == ["TOP601"]  # the read comes before the return


WARMUP = """\
import torch

def train(model, loader, opt, warmup_steps):
    for i, x in enumerate(loader):
        model(x).sum().backward()
        opt.step()
        if i == warmup_steps:
            torch.cuda.synchronize()
"""


def test_a_loop_counter_equal_to_a_name_runs_once():
    assert codes(WARMUP) == []
    assert codes(WARMUP.replace("i == warmup_steps", "warmup_steps == i")) == []
    # a name the loop changes, or a value that is not the loop's counter, may be equal at every step
    moving = WARMUP.replace("        opt.step()\n", "        opt.step()\n        warmup_steps = i\n")
    assert [c for _, c in codes(moving)] == ["TOP606"]
    other = WARMUP.replace("i == warmup_steps", "opt.state_count == warmup_steps")
    assert [c for _, c in codes(other)] == ["TOP606"]


EVAL_EVERY = """\
import torch

def evaluate(model, batches):
    for x in batches:
        print(model(x).sum().item())

def train(model, loader, opt, val, eval_every):
    for i, x in enumerate(loader):
        model(x).sum().backward()
        opt.step()
        if i % eval_every == 0:
            evaluate(model, val)
"""


def test_an_evaluation_loop_that_runs_every_few_training_steps():
    """Its reads are rare relative to the training loop: inline, or in a helper every call of which
    is rare. A helper also called after training, or handed on as a value, runs its loop as the
    program's evaluation too: its per-batch reads stay reported (as today for evaluation loops)."""
    assert codes(EVAL_EVERY) == []
    inline = EVAL_EVERY[EVAL_EVERY.index("def train") :].replace(
        "            evaluate(model, val)", "            for v in val:\n                print(model(v).sum().item())"
    )
    assert codes(inline) == []
    every_step = inline.replace("if i % eval_every == 0:", "if eval_every > 0:")
    assert [c for _, c in codes(every_step)] == ["TOP601"]
    assert [c for _, c in codes(EVAL_EVERY.replace("if i % eval_every == 0:", "if eval_every > 0:"))] == ["TOP601"]
    after = EVAL_EVERY + "    evaluate(model, val)\n"
    assert [c for _, c in codes(after)] == ["TOP601"]
    handed = EVAL_EVERY + "\nHOOKS = [evaluate]\n"
    assert [c for _, c in codes(handed)] == ["TOP601"]
    exported = '__all__ = ["evaluate"]\n' + EVAL_EVERY
    assert [c for _, c in codes(exported)] == ["TOP601"]


ACCUMULATE = """\
import torch

def train(model, batches, opt, val, accumulate, validate_every):
    for i in range(1000):
        for {inner}:
            model({batch}).sum().backward()
            opt.step()
        if i % validate_every == 0:
            for v in val:
                print(model(v).sum().item())
"""


def test_an_evaluation_every_few_steps_of_a_loop_that_accumulates_gradients():
    """The outer loop is no step loop (its backward passes run in the micro-batch loop), but each of
    its iterations is one step: its evaluation every few iterations is rare. Over a loader, the
    inner loop is the step loop and the outer one counts epochs: an evaluation there is one."""
    steps = ACCUMULATE.format(inner="_ in range(accumulate)", batch="next(batches)")
    assert codes(steps) == []
    assert [c for _, c in codes(steps.replace("i % validate_every == 0", "i > 2"))] == ["TOP601"]
    epochs = ACCUMULATE.format(inner="x in batches", batch="x")
    assert [c for _, c in codes(epochs)] == ["TOP601"]


# ------------------------------------------------------------------ the device of a fix

GPU_FLAG = """\
import argparse
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args([])

model = torch.nn.Linear(4, 1)
if args.gpu:
    model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = torch.nn.MSELoss()
torch.manual_seed(0)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]


def train():
    running = 0.0
    logged = []
    for i, (x, y) in enumerate(data):
        if args.gpu:
            x, y = x.cuda(), y.cuda()
        loss = crit(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        running += loss.item()
        if i % 3 == 2:
            logged.append(running / 3)
            running = 0.0
    return logged


logged = train()
"""


def test_no_device_literal_the_program_chose_only_under_a_flag():
    """The accumulator would be created with `device="cuda"` on a CPU-only run too."""
    out = fix_source(GPU_FLAG, S).text
    assert out == GPU_FLAG
    assert compare_programs(GPU_FLAG, out) == []  # the program still runs on the CPU
    (diag,) = [d for d in check_source(GPU_FLAG, S).diagnostics if d.code == "TOP601"]
    assert 'moves to "cuda" only under a condition' in diag.message
    # With a device expression of its own, the fix uses it; an unconditional `.cuda()` is a choice.
    src = GPU_FLAG.replace(
        "if args.gpu:\n    model.cuda()\n", 'device = torch.device("cuda" if args.gpu else "cpu")\nmodel.to(device)\n'
    ).replace(
        "        if args.gpu:\n            x, y = x.cuda(), y.cuda()\n", "        x, y = x.to(device), y.to(device)\n"
    )
    out = fix_source(src, S).text
    assert "running = torch.zeros((), dtype=torch.float64, device=device)" in out
    assert compare_programs(src, out) == []
    src = GPU_FLAG.replace(
        "        if args.gpu:\n            x, y = x.cuda(), y.cuda()\n", "        x, y = x.cuda(), y.cuda()\n"
    )
    out = fix_source(src, S).text
    assert 'running = torch.zeros((), dtype=torch.float64, device="cuda")' in out


# ------------------------------------------------------------------ the facts asked directly


class _Probe(Rule):
    code, name, family, message = "TOP000", "probe", "probe", "probe"


def _rule(src: str) -> tuple[_Probe, cst.Module]:
    wrapper = MetadataWrapper(cst.parse_module(src), unsafe_skip_copy=True)
    rule = _Probe(RuleContext(wrapper.module, {}, ("device", "dev", "*_device")))
    rule.resolving = rule.resolve(wrapper)  # kept alive: closing it drops the metadata
    rule.resolving.__enter__()
    return rule, wrapper.module


def _call(module: cst.Module, name: str) -> cst.Call:
    return next(
        n
        for n in walk(module, True)
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == name
    )


def _read(module: cst.Module, name: str) -> cst.Name:
    """The argument of the call `probe(name)`."""
    arg = _call(module, "probe").args[0].value
    assert isinstance(arg, cst.Name) and arg.value == name
    return arg


def test_value_facts_follow_rebinding_and_say_what_is_unknown():
    src = dedent("""\
        import torch

        def f(x, device, n: int):
            t = torch.zeros(3)
            t = t.to(device)
            probe(t)
    """)
    rule, module = _rule(src)
    v = placements(rule).value(_read(module, "t"))
    assert (v.kind, v.where) == (Kind.TENSOR, Where.UNKNOWN)
    assert v.unknown_part == "its device: `.to(...)` to `device`, which may be the CPU or a GPU"
    rule, module = _rule(src.replace("t = t.to(device)", "t = t.tolist()"))
    v = placements(rule).value(_read(module, "t"))
    assert (v.kind, v.on_host) == (Kind.SEQUENCE, True)
    rule, module = _rule(src.replace("probe(t)", "probe(x)"))
    assert placements(rule).value(_read(module, "x")).unknown_part == "what it holds: `x` is a parameter"


def test_control_facts_read_guards_from_the_condition():
    src = dedent("""\
        import torch

        def train(model, loader, opt, rank):
            for x, y in loader:
                try:
                    model(x).sum().backward()
                except torch.cuda.OutOfMemoryError:
                    oom()
                if rank != 0:
                    pass
                else:
                    main_only()
                if not is_main_process():
                    others()
                if torch.cuda.is_available() and rank == 0:
                    both()
    """)
    rule, module = _rule(src)
    control = control_of(rule)
    assert Guard.OOM in control.guards(_call(module, "oom"))
    assert control.guards(_call(module, "main_only")).flags == Guard.RANK0
    assert control.guards(_call(module, "others")).flags == Guard.NONE
    assert control.guards(_call(module, "both")).flags == Guard.RANK0 | Guard.DEVICE
    assert control.frequency(_call(module, "oom")).rate is Rate.ON_ERROR
    assert control.frequency(_call(module, "both")).rate is Rate.EVERY_STEP


def test_a_refused_accumulator_says_which_value_fact_is_missing():
    src = dedent("""\
        import torch
        import torch.nn.functional as F

        def train(model, loader, opt, device, weight):
            total = 0.0
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                total += loss.item() * weight
            return total
    """)
    (diag,) = [d for d in check_source(src, S).diagnostics if d.code == "TOP601"]
    assert "not rewritten: `weight` is not known to be a Python number (`weight` is a parameter)" in diag.message


def test_grad_norm_reads_and_data_dependent_shapes_follow_the_facts():
    src = in_step(
        "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "if step % 100 == 0:\n"
        "    print(norm.item())\n"
        "classes = y.cpu().unique()\n"
        "if step % 100 == 0:\n"
        "    hits = torch.nonzero(out > 0)",
        header="step = 0\n",
    )
    assert codes(src) == [(13, "TOP603")]
    every_step = src.replace("if step % 100 == 0:\n            ", "if step:\n            ")
    assert sorted(c for _, c in codes(every_step)) == ["TOP603", "TOP604", "TOP607"]


def test_a_loader_batch_has_no_device_until_it_is_moved():
    src = dedent("""\
        import torch
        from torch.utils.data import DataLoader

        loader = DataLoader(list(range(8)), batch_size=2)
        for x in loader:
            probe(x)
    """)
    rule, module = _rule(src)
    v = placements(rule).value(_read(module, "x"))
    assert v.unknown_part == "what it holds: a batch of the loader `loader`, not moved to a device yet"
    rule, module = _rule(src.replace("    probe(x)", '    x = x.to("cuda")\n    probe(x)'))
    v = placements(rule).value(_read(module, "x"))
    assert (v.kind, v.where, v.on_host) == (Kind.UNKNOWN, Where.DEVICE, False)


def test_a_counter_from_count_against_an_argparse_option_is_a_host_test():
    src = dedent("""\
        import argparse
        from itertools import count

        import torch

        parser = argparse.ArgumentParser()
        parser.add_argument("--log-interval", type=int, default=10)
        args = parser.parse_args([])


        def main(model, opt, env):
            for i_episode in count(1):
                loss = model(env.reset()).sum()
                loss.backward()
                opt.step()
                if i_episode % args.log_interval == 0:
                    print("episode", i_episode)
    """)
    assert codes(src) == []
    # a value of unknown origin in the same place is still a possible tensor
    assert [c for _, c in codes(src.replace("args.log_interval", "env.interval"))] == ["TOP605"]


def test_the_names_a_module_gives_for_its_children_are_strings():
    src = dedent("""\
        import torch
        import torch.nn as nn


        class Getter(nn.ModuleDict):
            def __init__(self, layers, flag=False):
                super().__init__(layers)
                self.flag = flag

            def forward(self, x):
                for name, module in self.named_children():
                    if name == "stem":
                        x = module(x)
                    elif name == "head" and self.flag:
                        x = module(x) * 2
                return x


        model = Getter({"stem": nn.Linear(4, 4), "head": nn.Linear(4, 1)}).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in loader:
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
            for pname, p in model.named_parameters():
                probe(pname)
                probe_tensor(p)
    """)
    assert [c for _, c in codes(src) if c == "TOP605"] == []
    rule, module = _rule(src)
    assert placements(rule).value(_read(module, "pname")).kind is Kind.STR
    assert placements(rule).value(_call(module, "probe_tensor").args[0].value).kind is Kind.TENSOR
    # the same method of an object that is not known to be a module gives values of unknown kind
    rule, module = _rule(src.replace("model.named_parameters()", "registry.named_parameters()"))
    assert placements(rule).value(_read(module, "pname")).kind is Kind.UNKNOWN
    src = src.replace("class Getter(nn.ModuleDict)", "class Getter(Base)")
    assert [c for _, c in codes(src) if c == "TOP605"] == ["TOP605", "TOP605"]


def test_numpy_results_and_numpy_arithmetic_are_host_arrays():
    src = dedent("""\
        import numpy as np
        import torch


        def fid(cov, cov2, t):
            probe(cov @ cov2)
            probe((cov + 1e-6) @ cov2)
            probe(t @ cov)
            probe(max(1, np.interp(3, [0, 5], [1, 4]).round()))
            probe(max(1, t))


        feats = np.ones((3, 4))
        stats = load()
        fid(np.cov(feats, rowvar=False), stats["cov"], stats["t"])
    """)
    rule, module = _rule(src)
    probes = [n.args[0].value for n in walk(module, True) if isinstance(n, cst.Call) and dotted(n.func) == "probe"]
    got = [placements(rule).value(p) for p in probes]
    assert [v.kind for v in got[:2]] == [Kind.ARRAY, Kind.ARRAY]
    # `tensor @ array` is a tensor: a value of unknown kind on the left stays unknown
    assert got[2].kind is Kind.UNKNOWN and not got[2].on_host
    # the larger of two host values is a host value; of a value of unknown kind, unknown
    assert got[3].on_host and not got[4].on_host


def test_a_numpy_matmul_is_no_float32_torch_matmul():
    src = dedent("""\
        import numpy as np
        import torch
        from scipy import linalg


        def calc_fid(cov, cov2):
            s, _ = linalg.sqrtm(cov @ cov2, disp=False)
            return float(np.trace(s))


        if __name__ == "__main__":
            g = torch.load("g.pt").cuda().eval()
            feats = []
            with torch.no_grad():
                for i in range(100):
                    feats.append(g(torch.randn(8, 512, device="cuda")).cpu().numpy())
            cov = np.cov(np.concatenate(feats), rowvar=False)
            print(calc_fid(cov, torch.load("stats.pt")["cov"]))
    """)
    s502 = Settings(select=("TOP502",))
    assert [d.code for d in check_source(src, s502).diagnostics] == []
    # a torch matmul in the same place is one
    torch_src = src.replace("cov = np.cov(np.concatenate(feats), rowvar=False)", "cov = torch.cat(feats).cuda()")
    assert [d.code for d in check_source(torch_src, s502).diagnostics] == ["TOP502"]
