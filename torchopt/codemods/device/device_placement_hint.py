"""TOP105 `device-placement-hint`: Points at device placement that costs a copy where none is needed, with advice:."""

from __future__ import annotations

from textwrap import dedent

from libcst.metadata import Assignment
from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.control import Guard, control_of
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import callee
from torchopt.analysis.names import is_tensor_name
from torchopt.analysis.names import method_call
from torchopt.analysis.names import reaching_values
from torchopt.analysis.names import torch_name
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import in_loop
from torchopt.analysis.syntax import source
from torchopt.analysis.transfers import end_of
from torchopt.analysis.transfers import move_device
from torchopt.analysis.transfers import mutated_names
from torchopt.analysis.transfers import start_of
from torchopt.analysis.values import classify_device
from torchopt.analysis.values import string_value
from torchopt.codemods.device import FAMILY
from torchopt.codemods.device.loop_prechecks import _LEGACY_TYPES, _could_match
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


class DevicePlacementHint(Rule):
    """## What it does
    Points at device placement that costs a copy where none is needed, with advice:

    * a tensor defined before a loop and moved with `.cuda()` / `.to(device)` inside it, although
      it is never reassigned in the loop;
    * `torch.tensor([...])` built inside a loop with `device=` or moved to the device right away,
      from numbers the program lists itself (a display or comprehension, here or bound to a name);
      not input data that arrives on the host every iteration (an environment's reward), and not a
      loop that stores one tensor per iteration (`table.append(...)`, `out[i] = ...`);
    * the legacy `t.type(torch.cuda.FloatTensor)` (or the string `'torch.cuda.FloatTensor'`);
    * `torch.tensor(t)` where `t` is already a tensor.

    ## Why is this slow
    Each `.cuda()` / `.to(device)` of a host tensor is a host→device copy; in a loop it is paid on
    every iteration although the data does not change. A tensor built from a Python list is filled
    on the host and then copied, and the copy from pageable memory synchronises the host with the
    device. `torch.tensor(t)` copies `t` through a slow generic path and warns.

    ## Example
    ```python
    w = torch.randn(128, 128)
    for x in batches:
        y = x @ w.cuda()
        mask = torch.tensor([1.0, 0.0, 1.0]).cuda()
    ```

    ## Use instead
    ```python
    w = torch.randn(128, 128).cuda()
    mask = torch.tensor([1.0, 0.0, 1.0], device='cuda')
    for x in batches:
        y = x @ w
    ```

    ## Fix safety
    Display-only: there is no automatic fix. Hoisting a move out of a loop is only correct when
    nothing in the loop depends on the host copy and the tensor does not change, which a
    syntactic check cannot prove; the message says what to change by hand.
    """

    code = "TOP105"
    name = "device-placement-hint"
    family = FAMILY
    message = "`{name}` is moved to the device on every iteration; move it once before the loop"
    literal_message = (
        "`{call}` builds a host tensor and copies it to the device every iteration "
        "(a host→device copy and a sync); build it once before the loop, or on the device"
    )
    type_message = "`{call}` uses a legacy tensor type; use `{suggestion}`"
    copy_message = "`{call}` copy-constructs from a tensor (and warns); use `{suggestion}`"
    fix_title = None
    safety = Safety.DISPLAY
    prefilter = (".cuda(", ".to(", ".type(", "tensor", "Tensor")

    @classmethod
    def could_match(cls, text: str) -> bool:
        # What visit_Call can report on (mirrored on CPython's ast): a `.type(<torch.cuda legacy
        # type>)`, a `torch.tensor(...)` copy-constructing from a name or built in a loop, or an
        # invariant `<name>.cuda()`/`.to(<device>)` in a loop.
        return super().could_match(text) and _could_match(text)

    examples = (
        Invalid(
            "import torch\n\ndef run(xs):\n    w = torch.randn(4, 4)\n    out = []\n"
            "    for x in xs:\n        out.append(x @ w.cuda())\n    return out\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndevice = 'cuda'\nmask = torch.ones(3)\ni = 0\n"
            "while i < 10:\n    m = mask.to(device)\n    i += 1\n",
            after=None,
        ),
        Invalid("import torch\n\nfor step in range(10):\n    t = torch.tensor([1.0, 2.0, 3.0]).cuda()\n", after=None),
        Invalid(
            "import torch\n\ndef f(rows, device):\n    for r in rows:\n"
            "        t = torch.tensor([v * 2 for v in r], device=device)\n",
            after=None,
        ),
        Invalid("import torch\n\ndef f(t):\n    return t.type(torch.cuda.FloatTensor)\n", after=None),
        Invalid("def f(t):\n    return t.type('torch.cuda.HalfTensor')\n", after=None),
        Invalid(
            "import torch\n\na = torch.zeros(3)\nb = torch.tensor(a)\n", after=None, note="suggest a.detach().clone()"
        ),
        Valid(
            "import torch\n\ndef run(xs, device):\n    w = torch.randn(4, 4)\n"
            "    for x in xs:\n        w = w.to(device)\n        x = x @ w\n",
            note="`w` is reassigned in the loop",
        ),
        Valid(
            "import torch\n\ndef run(xs):\n    for x in xs:\n        x = x.cuda()\n",
            note="the loop target changes every iteration",
        ),
        Valid(
            "import torch\n\nw = torch.randn(3)\nfor i in range(3):\n    w.add_(1)\n    v = w.cuda()\n",
            note="`w` changes in the loop",
        ),
        Valid("import torch\n\nw = torch.randn(3)\nfor i in range(3):\n    v = w.to('cpu')\n", runnable=True),
        Valid("import torch\n\nt = torch.tensor([1.0, 2.0]).cuda()\n", note="not in a loop"),
        Valid("import torch\n\nb = torch.tensor([1, 2])\nc = torch.tensor(b.tolist())\n", runnable=True),
        Invalid(
            dedent("""\
                import torch

                def scale(loader, device):
                    for images, boxes in loader:
                        h, w = images.shape[-2:]
                        size = (w, h, w, h)
                        boxes = boxes.to(device) * torch.tensor(size, device=device)
            """),
            after=None,
            note="a name bound to a tuple the program writes: built on the host and copied every batch",
        ),
        Valid(
            dedent("""\
                import torch

                def collect(envs, policy, obs, rewards, device):
                    for step in range(128):
                        action = policy(obs)
                        obs, reward, done, info = envs.step(action)
                        rewards[step] = torch.tensor(reward).to(device).view(-1)
            """),
            note="the environment's reward is the loop's input data: it arrives on the host every step",
        ),
        Valid(
            dedent("""\
                import torch

                def schedule(n, device):
                    weights = []
                    for s in range(n):
                        w = [1.0, 0.5 * (1 - s / n)]
                        weights.append(torch.tensor(w, device=device))
                    return weights
            """),
            note="one tensor per entry of a precomputed table: building it once before the loop cannot replace it",
        ),
        Valid("def f(t, kind):\n    return t.type(kind)\n"),
        Valid(
            dedent("""\
                import argparse
                import torch

                parser = argparse.ArgumentParser()
                parser.add_argument("--offload-ema", action="store_true")
                args = parser.parse_args()

                def train(model, ema, loader):
                    for x in loader:
                        model(x).sum().backward()
                        if args.offload_ema:
                            ema.to("cuda")
            """),
            note="only under an option off by default, whose purpose is to keep the copy on the host between steps",
        ),
    )

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute):
            attr = node.func.attr.value
            if attr == "type":
                self._legacy_type(node)
            elif attr in ("cuda", "to"):
                self._loop_move(node)
        name = callee(self, node)
        if name == "torch.tensor":
            self._tensor_call(node)

    # (i) and (ii, moved form)
    def _loop_move(self, node: cst.Call) -> None:
        mv = move_device(self, node)
        if mv is None:
            return
        recv = cst.ensure_type(node.func, cst.Attribute).value  # (visit_Call sends only method calls)
        loop = None
        if isinstance(recv, cst.Name):
            loop = in_loop(self, node)
            if loop is not None and self._invariant(recv, loop):
                if Guard.OFF_BY_DEFAULT in control_of(self).guards(node, loop.body):
                    return  # the default run never moves it: the user asks for this (an offload switch)
                self.report(node, fmt={"name": recv.value})
            return
        mc = method_call(node, ("cuda", "to"))
        if mc is None:
            return
        inner = mc[0]
        if (
            callee(self, inner) == "torch.tensor"
            and self._host_data(inner)
            and in_loop(self, node)
            and not self._kept(node)
        ):
            self.report(node, message=self.literal_message, fmt={"call": source(self, node)})

    def _invariant(self, name: cst.Name, loop: cst.For | cst.While) -> bool:
        try:
            scope = self.get_metadata(ScopeProvider, name)
        except KeyError:
            return False
        if scope is None or name.value not in scope:
            return False
        assignments = list(scope[name.value])
        if not assignments:
            return False
        loop_start = start_of(self, loop)
        for a in assignments:
            if not isinstance(a, Assignment) or a.scope is not scope:
                return False
            try:
                if end_of(self, a.node) > loop_start:
                    return False
            except KeyError:
                return False
        return name.value not in mutated_names(loop)

    # (ii, device= form) and (iv)
    def _tensor_call(self, node: cst.Call) -> None:
        if has_star(node):
            return
        args = positional(node)
        if not args:
            return
        data = args[0].value
        parent = self.get_metadata(ParentProvider, node, None)
        grand = self.get_metadata(ParentProvider, parent, None) if parent is not None else None
        moved = (
            isinstance(parent, cst.Attribute)
            and isinstance(grand, cst.Call)
            and grand.func is parent
            and parent.attr.value in ("cuda", "to")
            and move_device(self, grand) is not None
        )
        if isinstance(data, cst.Name) and is_tensor_name(self, data):
            dev = keyword(node, "device")
            dtype = keyword(node, "dtype")
            parts = []
            if dev is not None:
                parts.append(f"device={source(self, dev.value)}")
            elif moved:
                assert isinstance(grand, cst.Call)
                mv = move_device(self, grand)
                parts.append(source(self, mv[1]) if mv and mv[1] is not None else "'cuda'")
            if dtype is not None:
                parts.append(f"dtype={source(self, dtype.value)}")
            suggestion = f"{data.value}.detach().to({', '.join(parts)})" if parts else f"{data.value}.detach().clone()"
            self.report(node, message=self.copy_message, fmt={"call": source(self, node), "suggestion": suggestion})
            return
        if moved:
            return  # reported at the move
        dev = keyword(node, "device")
        if dev is None:
            return
        d = classify_device(self, dev.value)
        if not d.is_device or d.is_cpu or d.text == "meta":
            return
        if self._host_data(node) and in_loop(self, node) and not self._kept(node):
            self.report(node, message=self.literal_message, fmt={"call": source(self, node)})

    def _host_data(self, call: cst.Call) -> bool:
        """The tensor is built from numbers the program lists itself (a display or a comprehension,
        written here or bound to a name), the kind of data that can be built once or on the device.
        A name bound to anything else (an environment's reward, a decoded file) is input data the
        program receives every iteration: its copy is the data feed, not a placement choice."""
        args = positional(call)
        if not args or has_star(call):
            return False
        data = args[0].value
        if _displayed(data):
            return True
        if not isinstance(data, cst.Name) or is_tensor_name(self, data):
            return False
        values = reaching_values(self, data)
        return bool(values) and all(v is not None and _displayed(v) for v in values or ())

    def _kept(self, node: cst.CSTNode) -> bool:
        """Each iteration's tensor is stored (``out.append(...)``, ``table[i] = ...``): the loop builds a
        collection, one tensor per entry, which building once before the loop cannot replace."""
        expr = node
        parent = self.get_metadata(ParentProvider, expr, None)
        while isinstance(parent, cst.Attribute):  # `.view(-1)` and other methods chained on the result
            call = self.get_metadata(ParentProvider, parent, None)
            if not (isinstance(call, cst.Call) and call.func is parent):
                return False
            expr, parent = call, self.get_metadata(ParentProvider, call, None)
        if isinstance(parent, cst.Arg):
            call = self.get_metadata(ParentProvider, parent, None)
            return (
                isinstance(call, cst.Call)
                and isinstance(call.func, cst.Attribute)
                and call.func.attr.value in ("append", "insert", "add")
            )
        return (
            isinstance(parent, cst.Assign)
            and parent.value is expr
            and all(isinstance(t.target, cst.Subscript) for t in parent.targets)
        )

    # (iii)
    def _legacy_type(self, node: cst.Call) -> None:
        args = positional(node)
        if len(node.args) != 1 or len(args) != 1:
            return
        arg = args[0].value
        q = string_value(arg)
        if q is None:
            q = torch_name(self, arg)
        if not q or not q.startswith("torch.cuda."):
            return
        dtype = _LEGACY_TYPES.get(q[len("torch.cuda.") :])
        if dtype is None:
            return
        recv = cst.ensure_type(node.func, cst.Attribute).value  # (visit_Call sends only method calls)
        if torch_name(self, recv) is not None:  # torch.cuda.FloatTensor.type(...) etc.
            return
        ref = torch_ref(self)
        tname = ref.name if ref is not None else "torch"
        suggestion = f"{source(self, recv)}.to(device='cuda', dtype={tname}.{dtype})"
        self.report(node, message=self.type_message, fmt={"call": source(self, node), "suggestion": suggestion})


def _displayed(data: cst.BaseExpression) -> bool:
    if isinstance(data, (cst.List, cst.Tuple)):
        return bool(data.elements)  # `torch.tensor([])` copies nothing
    return isinstance(data, cst.ListComp)
