"""The model lifecycle facts (torchopt/analysis/lifecycle.py): where each module is built, loaded,
trained, evaluated and exported, and which mode it is in at each statement; UNKNOWN where the file
does not tell."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import MetadataWrapper

from torchopt.analysis.lifecycle import Mode, Phase, lifecycle_of
from torchopt.rewrite.rule import Rule, RuleContext


class _Probe(Rule):
    code, name, family, message = "TOP000", "probe", "probe", "probe"


def _facts(src: str):
    wrapper = MetadataWrapper(cst.parse_module(dedent(src)), unsafe_skip_copy=True)
    rule = _Probe(RuleContext(wrapper.module, {}, ("device", "dev", "*_device")))
    rule.resolving = rule.resolve(wrapper)  # kept alive: closing it drops the metadata
    rule.resolving.__enter__()
    return lifecycle_of(rule), wrapper.module


def _call(module: cst.Module, text: str, nth: int = 0) -> cst.Call:
    found: list[cst.Call] = []

    class V(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if module.code_for_node(node) == text:
                found.append(node)

    module.visit(V())
    return found[nth]


def _statement(module: cst.Module, text: str) -> cst.CSTNode:
    found: list[cst.CSTNode] = []

    class V(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
            if module.code_for_node(node).strip() == text:
                found.append(node)

    module.visit(V())
    return found[0]


def test_phases_of_an_inference_script():
    lc, m = _facts("""\
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 2)
        model.load_state_dict(torch.load("w.pt"))
        model.eval()
        with torch.no_grad():
            out = model(torch.ones(1, 4))
        torch.onnx.export(model, torch.ones(1, 4), "m.onnx")
    """)
    assert lc.phases_in(_statement(m, "model = nn.Linear(4, 2)")) == {Phase.CONSTRUCTION}
    assert lc.phases_in(_statement(m, 'model.load_state_dict(torch.load("w.pt"))')) == {Phase.LOADING}
    assert lc.phases_in(_statement(m, "out = model(torch.ones(1, 4))")) == {Phase.EVALUATION}
    assert lc.phases_in(_statement(m, 'torch.onnx.export(model, torch.ones(1, 4), "m.onnx")')) == {Phase.EXPORT}
    assert [o.name for o in lc.objects] == ["model"]
    assert lc.mode_at("model", _call(m, "model(torch.ones(1, 4))")) is Mode.EVAL
    assert lc.mode_at("model", _call(m, "model.eval()")) is Mode.TRAIN  # a fresh module trains


def test_a_factory_of_another_file_is_a_module_by_use_and_its_mode_is_unknown():
    lc, m = _facts("""\
        import torch
        from models import build_model

        model = build_model("resnet")
        model.load_state_dict(torch.load("w.pt"))
        model(torch.ones(1))
    """)
    assert lc.builds_or_loads(_statement(m, 'model = build_model("resnet")'))
    assert lc.mode_at("model", _call(m, "model(torch.ones(1))")) is Mode.UNKNOWN
    assert lc.objects[0].unknown_why is not None and "build_model" not in lc.objects[0].unknown_why
    # a name bound to a call never used as a module is no module object
    lc, m = _facts("import torch\nx = torch.load('x.pt')\nprint(x)\n")
    assert lc.objects == []


def test_eval_in_a_chain_a_helper_and_a_factory_of_the_file():
    lc, m = _facts("""\
        import torch.nn as nn


        def load(path):
            net = nn.Linear(4, 2)
            net.eval()
            return net


        def freeze(model):
            model.eval()


        a = nn.Linear(4, 2).eval()
        b = load("w.pt")
        c = nn.Linear(4, 2)
        freeze(c)
        a(1), b(2), c(3)
    """)
    assert lc.mode_at("a", _call(m, "a(1)")) is Mode.EVAL
    assert lc.mode_at("b", _call(m, "b(2)")) is Mode.EVAL
    assert lc.mode_at("c", _call(m, "c(3)")) is Mode.EVAL
    assert lc.mode_at("c", _call(m, "freeze(c)")) is Mode.TRAIN


def test_branches_and_loops_join_modes():
    lc, m = _facts("""\
        import torch.nn as nn

        model = nn.Linear(4, 2)
        if flag:
            model.eval()
        model(1)
        for epoch in range(3):
            model(2)
            model.eval()
        model(3)
    """)
    assert lc.modes_at("model", _call(m, "model(1)")) == {Mode.TRAIN, Mode.EVAL}
    assert lc.modes_at("model", _call(m, "model(2)")) == {Mode.TRAIN, Mode.EVAL}
    assert lc.mode_at("model", _call(m, "model(1)")) is Mode.UNKNOWN


def test_part_modes_do_not_change_the_whole():
    lc, m = _facts("""\
        import torch.nn as nn


        def set_bn_eval(model):
            for mod in model.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.eval()


        model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3))
        model.train()
        model[0].eval()
        model.backbone.eval()
        set_bn_eval(model)
        model.apply(set_bn_eval)
        ddp.module.eval()
        model(1)
    """)
    assert lc.mode_at("model", _call(m, "model(1)")) is Mode.TRAIN
    part = lc.mode_event(_call(m, "model.backbone.eval()"))
    assert part is not None and part.part == "backbone" and part.mode is Mode.EVAL
    layers = lc.mode_event(_call(m, "mod.eval()"))
    assert layers is not None and layers.part == "the layers `mod` of `model.modules()`"
    assert not lc.sets_whole_mode(_call(m, "set_bn_eval(model)"), Mode.EVAL)
    assert not lc.sets_whole_mode(_call(m, "model.backbone.eval()"), Mode.EVAL)
    assert lc.sets_whole_mode(_call(m, "ddp.module.eval()"), Mode.EVAL)


def test_a_parameter_takes_the_modes_of_its_call_sites():
    lc, m = _facts("""\
        import torch.nn as nn


        def evaluate(model, loader):
            return [model(x) for x in loader]


        def orphan(model):
            return model(0)


        net = nn.Linear(4, 2)
        net.eval()
        evaluate(net, [])
    """)
    assert lc.mode_at("model", _call(m, "model(x)")) is Mode.EVAL
    assert lc.mode_at("model", _call(m, "model(0)")) is Mode.UNKNOWN


def test_training_phase_and_a_pretrained_factory():
    lc, m = _facts("""\
        import torch
        import torchvision

        model = torchvision.models.resnet18(weights="DEFAULT")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = model(x).sum()
            loss.backward()
            opt.step()
        torch.save(model.state_dict(), "m.pt")
    """)
    assert lc.phases_in(_statement(m, 'model = torchvision.models.resnet18(weights="DEFAULT")')) == {
        Phase.CONSTRUCTION,
        Phase.LOADING,
    }
    assert Phase.TRAINING in lc.phases_in(_statement(m, "opt = torch.optim.SGD(model.parameters(), lr=0.1)"))
    assert Phase.TRAINING in lc.phases_in(_statement(m, "loss = model(x).sum()"))
    assert Phase.EXPORT in lc.phases_in(_statement(m, 'torch.save(model.state_dict(), "m.pt")'))
    assert lc.mode_at("model", _call(m, "model(x)")) is Mode.TRAIN


NESTED_HELPERS = """\
    import torch


    def infer(model, images, level=0):
        def basic(inputs, net):
            return net(inputs).clone()

        def mirror(inputs, net):
            return 0.5 * net(inputs) + 0.5 * net(inputs.flip(-1))

        def mirror_shift(inputs, net):
            return mirror(inputs, net) + mirror(inputs.roll(1, -1), net)

        def leaked(inputs, net):
            return net(inputs + 1)

        model.eval()
        fn = [basic, mirror, mirror_shift][level]
        with torch.no_grad():
            out = torch.cat([fn(x, model) for x in images.split(2)])
        {tail}
        return out
"""


def test_a_nested_helper_called_only_under_no_grad_inherits_it_and_its_callers_mode():
    lc, m = _facts(NESTED_HELPERS.format(tail="pass"))
    for text in ("net(inputs)", "net(inputs + 1)"):
        call = _call(m, text)
        expected = text == "net(inputs)"
        assert lc.grad_off(call) is expected, text
    # through the pick `fn = [...][level]`, directly, and from another nested helper
    assert lc.grad_off(_call(m, "net(inputs.flip(-1))"))
    assert lc.mode_at("net", _call(m, "net(inputs)")) is Mode.EVAL
    assert lc.mode_at("net", _call(m, "net(inputs.flip(-1))")) is Mode.EVAL
    assert lc.mode_at("net", _call(m, "net(inputs + 1)")) is Mode.UNKNOWN  # nothing calls it


def test_a_nested_helper_also_used_with_autograd_on_or_handed_out_inherits_nothing():
    lc, m = _facts(NESTED_HELPERS.format(tail="out = out + basic(images, model)"))
    assert not lc.grad_off(_call(m, "net(inputs)"))
    assert lc.grad_off(_call(m, "net(inputs.flip(-1))"))  # mirror is still only called under no_grad
    lc, m = _facts(NESTED_HELPERS.format(tail="return mirror"))
    assert not lc.grad_off(_call(m, "net(inputs.flip(-1))"))  # returned: called who knows where
    lc, m = _facts(
        NESTED_HELPERS.replace(
            "return net(inputs).clone()", "with torch.enable_grad():\n                return net(inputs).clone()"
        ).format(tail="pass")
    )
    assert not lc.grad_off(_call(m, "net(inputs)"))  # autograd back on inside the helper
    lc, m = _facts(NESTED_HELPERS.replace("model.eval()", "pass").format(tail="pass"))
    assert lc.mode_at("net", _call(m, "net(inputs)")) is Mode.UNKNOWN  # model's mode is not set


def test_a_resume_checkpoint_is_a_round_trip_and_an_export_is_not():
    from torchopt.analysis.checkpoints import round_trip

    lc, m = _facts(RESUME)
    load = _call(m, 'model.load_state_dict(ckpt["model"])')
    resume_save, export = _call(m, "model.state_dict()", 0), _call(m, "model.state_dict()", 1)
    assert round_trip(lc.rule, load) and round_trip(lc.rule, resume_save)
    assert not round_trip(lc.rule, export)  # final.pt is read by nobody here
    lc, m = _facts(RESUME.replace('torch.load("resume.pt")', 'torch.load("other.pt")'))
    assert not round_trip(lc.rule, _call(m, 'model.load_state_dict(ckpt["model"])'))
    assert not round_trip(lc.rule, _call(m, "model.state_dict()", 0))


RESUME = """\
    import os

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(4, 2))
    if os.path.isfile("resume.pt"):
        ckpt = torch.load("resume.pt")
        model.load_state_dict(ckpt["model"])
    for epoch in range(3):
        state = dict(epoch=epoch, model=model.state_dict())
        torch.save(state, "resume.pt")
    torch.save(model.state_dict(), "final.pt")
"""
