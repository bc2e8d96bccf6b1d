"""The shared program model (torchopt/analysis/program.py) on the layouts real training scripts use:
a module-level loop, a step in a function fed by `main()`, a trainer class, spawned workers, devices
chosen in several ways, and aliases. Where the file does not tell, the model answers None."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper

from torchopt.analysis.program import Program, program_of
from torchopt.rewrite.rule import Rule, RuleContext

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class _Probe(Rule):
    code, name, family, message = "TOP000", "probe", "probe", "probe"


def _model(src: str):
    """(program, module, rule) for ``src``; metadata is resolved on demand through the rule."""
    wrapper = MetadataWrapper(cst.parse_module(src), unsafe_skip_copy=True)
    rule = _Probe(RuleContext(wrapper.module, {}, ("device", "dev", "*_device")))
    rule.resolving = rule.resolve(wrapper)  # kept alive: closing it drops the metadata
    rule.resolving.__enter__()
    return program_of(rule), wrapper.module, rule


def _fixture(name: str):
    return _model((FIXTURES / name / "before.py").read_text())


def _calls(module: cst.Module, text: str) -> list[cst.Call]:
    found = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if module.code_for_node(node.func) == text:
                found.append(node)

    module.visit(V())
    return found


def _kind(program: Program, module: cst.Module, call_text: str) -> str | None:
    call = _calls(module, call_text)[0]
    role = program.role_of(call.func, call)
    return role.kind if role is not None else None


def _receiver_kind(program: Program, module: cst.Module, call_text: str) -> str | None:
    call = _calls(module, call_text)[0]
    role = program.role_of(call.func.value, call)
    return role.kind if role is not None else None


def test_a_module_loop_roles_and_step():
    program, module, _ = _fixture("layout_a_module_loop")
    found = {
        kind: [r.path[-1] for r in program.roles(kind)]
        for kind in ("optimizer", "scheduler", "loader", "loss", "device")
    }
    assert found == {
        "optimizer": ["optimizer"],
        "scheduler": ["scheduler"],
        "loader": ["loader"],
        "loss": ["criterion"],
        "device": ["device"],
    }
    assert _kind(program, module, "model") == "model"
    [step] = [s for s in program.steps if s.kind == "training"]
    assert step.function is None and step.body_function is None
    assert program.entry.kind == "module" and program.entry.launcher is None


def test_b_parameters_take_the_role_of_what_main_passes():
    program, module, _ = _fixture("layout_b_train_function")
    assert _kind(program, module, "model") == "model"  # `model` is a parameter of `train`
    assert _receiver_kind(program, module, "optimizer.step") == "optimizer"
    [train] = [s for s in program.steps if s.kind == "training"]
    assert train.function is not None and train.function.qualname == "train"
    assert [e.caller for e in program.functions["train"].callers] == ["main"]
    assert module.code_for_node(program.device_at(train.backward)) == "device"
    assert program.entry.kind == "main-guard"


def test_c_trainer_attributes_follow_the_constructor_and_a_tuple_return():
    program, module, _ = _fixture("layout_c_trainer_class")
    assert _kind(program, module, "self.model") == "model"
    assert _receiver_kind(program, module, "self.optimizer.step") == "optimizer"
    [step] = [s for s in program.steps if s.kind == "training"]
    assert step.function.qualname == "Trainer._run_epoch"
    assert step.body_function.qualname == "Trainer._run_batch"
    assert module.code_for_node(program.device_at(step.backward)) == "self.gpu_id"
    assert ("main", "Trainer.__init__", "constructor") in {(e.caller, e.callee, e.how) for e in program.edges}


def test_c_library_trainer_alone_is_unknowable():
    src = (FIXTURES / "layout_c_trainer_class" / "before.py").read_text().split("def load_train_objs")[0]
    program, module, _ = _model(src)
    assert _kind(program, module, "self.model") is None  # never guessed from the attribute's name
    assert _receiver_kind(program, module, "self.optimizer.step") is None
    assert any("`Trainer` is built outside this file" in u for u in program.unknowns)


def test_d_spawned_worker_runs_in_every_process_and_main_does_not():
    src = (
        "import torch\nimport torch.multiprocessing as mp\n\n"
        "def worker(rank, world):\n    step(rank)\n\n"
        "def step(rank):\n    return rank\n\n"
        "def main():\n    mp.spawn(worker, args=(2,), nprocs=2)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    program, module, _ = _model(src)
    assert [w.qualname for w in program.entry.workers] == ["worker"] and program.entry.launcher == "spawn"
    assert program.runs_per_process(program.functions["step"].node.body)
    assert not program.runs_per_process(program.functions["main"].node.body)
    spawn = [e for e in program.edges if e.how == "spawn"]
    assert [(e.caller, e.callee) for e in spawn] == [("main", "worker")]


def test_d_torchrun_script_runs_everywhere():
    program, module, _ = _model("import os\nimport torch\nrank = int(os.environ['LOCAL_RANK'])\nx = 1\n")
    assert program.entry.launcher == "torchrun"
    assert program.runs_per_process(module.body[-1])


@pytest.mark.parametrize(
    "expr, kind",
    [
        ("torch.accelerator.current_accelerator()", "device"),
        ('"cuda:0"', "device"),
        ('torch.device(f"cuda:{rank}")', "device"),
        ('0 if torch.cuda.is_available() else "cpu"', "device"),
        ("0", None),  # an integer alone is a count, not a device
        ("args.device", None),  # what the command line holds is not known
    ],
)
def test_e_devices(expr, kind):
    program, module, _ = _model(f"import torch\nrank = 1\ndev = {expr}\nuse(dev)\n")
    call = _calls(module, "use")[0]
    role = program.role_of(call.args[0].value, call)
    assert (role.kind if role else None) == kind


def test_e_device_of_a_step_that_moves_to_a_parameter_or_model_cuda():
    program, module, _ = _fixture("layout_e_devices")
    [step] = [s for s in program.steps if s.kind == "training"]
    assert module.code_for_node(program.device_at(step.backward)) == "device"
    program, module, _ = _model("import torch\ndef w(gpu, model):\n    model.cuda(gpu)\n    x.backward()\n")
    assert module.code_for_node(program.device_at(_calls(module, "x.backward")[0])) == "gpu"


def test_f_aliases_and_compiled_models():
    program, module, _ = _fixture("layout_f_aliases")
    assert _kind(program, module, "fast") == "model"  # fast = torch.compile(net, ...)
    assert [r.path[-1] for r in program.roles("loader")] == ["batches"]  # DataLoader as DL
    assert "Regressor" in program.module_classes  # class Regressor(tnn.Module)
    src = "import torch\n@torch.compile\ndef f(x):\n    return x\n"
    assert _model(src)[0].functions["f"].compiled


def test_a_name_bound_twice_to_different_things_has_no_role():
    src = (
        "import torch\nimport torch.nn as nn\nif flag:\n    thing = nn.Linear(2, 2)\nelse:\n"
        "    thing = torch.optim.SGD([], lr=1)\nthing(1)\n"
    )
    program, module, _ = _model(src)
    assert _kind(program, module, "thing") is None


def test_parameters_of_functions_called_with_different_things_have_no_role():
    src = "import torch\nimport torch.nn as nn\ndef f(m):\n    m(1)\nf(nn.Linear(1, 1))\nf(torch.optim.SGD([], lr=1))\n"
    program, module, _ = _model(src)
    assert _kind(program, module, "m") is None
