"""TOP101 factory-then-move's checks: a legacy CUDA constructor; the device a trailing ``.cuda()`` /
``.to()`` names and what creating the values there changes (random draws, device kernels, a folded
dtype); and ``x[<factory>(...)]`` with ``x`` a tensor that may be on a device, directly or through
names (index_sources)."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import ScopeProvider

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import keyword
from torchopt.analysis.arguments import set_kwarg
from torchopt.analysis.arguments import positional
from torchopt.analysis.names import TorchRef
from torchopt.analysis.names import dotted
from torchopt.analysis.names import is_tensor_name
from torchopt.analysis.placement import Kind, Where, placements
from torchopt.analysis.run_once import once_per_process
from torchopt.analysis.syntax import has_comments
from torchopt.analysis.syntax import source
from torchopt.analysis.transfers import start_of
from torchopt.analysis.values import Device
from torchopt.analysis.values import DeviceKind
from torchopt.analysis.values import classify_device
from torchopt.analysis.values import dtype_of
from torchopt.analysis.values import int_value
from torchopt.codemods.device.dtype_folding import Data, arange_exact_on_device, fold_verdict
from torchopt.codemods.device.factory_analysis import TrailingCall, _FactoryRule, _NOTE_LEAF, int_typed, may_be_int
from torchopt.codemods.device.factory_tables import COMPUTED, CUDA_LEGACY, INDEX_FACTORIES, LEGACY, RANDOM, SPELLING
from torchopt.codemods.device.move_edits import moved_factory
from torchopt.codemods.device.index_sources import device_reads_before, index_sources, rewritten
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Later
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Tag


_NOTE_RNG = "random values are drawn on {where} from its generator instead of the CPU one: they change, and later CPU random draws shift"


_NOTE_INDEX_MATH = "the index arithmetic runs on the device instead of the host: float steps may differ by about 1 ulp"


_NOTE_TOL = "values are computed by a device kernel instead of on the host: they may differ by about 1 ulp"


class _MoveChecks(_FactoryRule):
    """What FactoryThenMove asks of a move (abstract: no ``code``)."""

    def _host_index(self, node: cst.Subscript, inner: cst.Call) -> None:
        """``x[<factory>(...)]`` (or a rearranging chain of it) with ``x`` a tensor that may be on a
        device: the host index is copied to ``x``'s device at every indexing; create it there."""
        fk = self.factory_of(inner)
        if fk is None:
            return
        kind, _q = fk
        if kind not in INDEX_FACTORIES or keyword(inner, "device") is not None:
            return
        if self.follows_default_device(kind):
            return  # under `torch.set_default_device(...)` the index may be built on the device already
        if self.requires_grad(inner) or self.factory_blockers(kind, inner) or self._skipped_arguments(kind, inner):
            return
        if kind == "tensor" and self._is_tensor_data(inner):
            return
        base = node.value
        name = dotted(base)
        if name is None:
            return  # its device is read again at the factory: only a name or an attribute path
        value = placements(self).value(base)
        if value.kind is not Kind.TENSOR or value.where is Where.HOST:
            return  # not a tensor, or one on the host: no copy
        if once_per_process(self, node):
            return
        pin = keyword(inner, "pin_memory")
        if pin is not None and has_comments(pin):
            return  # the fix drops it: a comment would be lost
        dev_expr = cst.Attribute(value=base.deep_clone(), attr=cst.Name("device"))
        tags, notes = self._device_tags(kind, inner, Device(DeviceKind.CONVENTION), False)
        tr = TrailingCall(device=dev_expr)
        new, imports = moved_factory(inner, kind, self.ref_at(inner), tr, dev_expr, False)
        self.report(
            inner,
            fmt={"factory": source(self, inner.func), "x": name},
            message="`{factory}(...)` is created on the host to index the tensor `{x}`: when `{x}` is on a "
            "device, the index is copied there at every indexing",
            fix_title="Create it on `{x}.device`",
            replacement=new,
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tuple(tags),
            note="; ".join(notes),
            imports=imports,
        )

    def _host_index_named(self, node: cst.Subscript, expr: cst.BaseExpression) -> None:
        """``x[i]`` with ``i`` computed on the host from torch factories through names of the same
        function (index_sources): create every one of them on ``x.device``."""
        base = node.value
        assert isinstance(base, cst.Name)  # (visit_Subscript asks only for a name)
        value = placements(self).value(base)
        if value.kind is not Kind.TENSOR or value.where is Where.HOST:
            return
        fn = self._function_of(node)
        if fn is None:
            return
        try:
            scope = self.get_metadata(ScopeProvider, node)
        except KeyError:
            return
        found = index_sources(self, expr, scope)
        if found is None or once_per_process(self, node):
            return
        calls = found.factories
        fmt = {
            "factory": source(self, calls[0][0].func),
            "x": base.value,
            "names": "`, `".join(found.names),
            "line": str(start_of(self, calls[0][0])[0]),
        }
        message = (
            "the index of the tensor `{x}` is computed on the host from `{factory}(...)` (line {line}, through "
            "`{names}`): when `{x}` is on a device, it is copied there at every indexing"
        )
        if not device_reads_before(self, base, calls):
            self.report(node, fmt=fmt, message=message + "; not fixed: `{x}` is bound after the factory")
            return
        ref = self.ref_at(node)
        tags: list[Tag] = []
        notes: list[str] = []
        new: dict[int, cst.Call] = {}
        for call, kind in calls:
            dev_expr = cst.Attribute(value=cst.Name(base.value), attr=cst.Name("device"))
            t, n = self._device_tags(kind, call, Device(DeviceKind.CONVENTION), False)
            tags += [x for x in t if x not in tags]
            notes += [x for x in n if x not in notes]
            new[id(call)] = moved_factory(call, kind, ref, TrailingCall(device=dev_expr), dev_expr, False)[0]
        if found.arithmetic and Tag.TOLERANCE not in tags:
            tags.append(Tag.TOLERANCE)
            notes.append(_NOTE_INDEX_MATH)
        self.report(
            node,
            fmt=fmt,
            message=message,
            fix_title="Create the index's factories on `{x}.device`",
            replacement=Later(lambda: rewritten(fn, new)),
            target=fn,
            safety=Safety.UNSAFE if tags else Safety.SAFE,
            tags=tuple(tags),
            note="; ".join(notes),
        )

    def _function_of(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        cur = self.get_metadata(ParentProvider, node, None)
        while cur is not None and not isinstance(cur, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            cur = self.get_metadata(ParentProvider, cur, None)
        return cur if isinstance(cur, cst.FunctionDef) else None

    def _skipped_arguments(self, kind: str, inner: cst.Call) -> bool:
        """Factory calls whose meaning the fix cannot keep: legacy constructors given data or sizes
        we cannot see (overloaded), ``from_numpy`` not called with one array, and random factories
        fed by a generator (a CPU generator cannot feed a CUDA factory)."""
        if kind in LEGACY and (
            not inner.args or any(a.keyword is not None or a.star or int_value(a.value) is None for a in inner.args)
        ):
            return True
        if kind == "from_numpy" and (len(inner.args) != 1 or inner.args[0].keyword is not None):
            return True
        return kind in RANDOM and keyword(inner, "generator") is not None

    def _cuda_target(
        self, node: cst.Call, tr: TrailingCall, ref: TorchRef | None, factory: str
    ) -> tuple[cst.BaseExpression, Device] | None:
        """The ``device=`` expression for ``.cuda([x])`` and what it names; None (reported) when
        ``x`` may be an index or a device, or when ``torch.device`` cannot be spelled here."""
        if tr.device is None:
            return cst.SimpleString("'cuda'"), Device(DeviceKind.LITERAL, "cuda")
        index = int_value(tr.device)
        if index is not None:
            return cst.SimpleString(f"'cuda:{index}'"), Device(DeviceKind.LITERAL, f"cuda:{index}")
        if int_typed(self, tr.device):
            if ref is None:
                self.report(
                    node,
                    fmt={
                        "factory": factory,
                        "device": source(self, tr.device),
                        "assumption": " (no fix: `torch` is bound to something else here)",
                    },
                )
                return None
            comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            device_call = cst.Call(
                func=ref.attr("device"), args=[cst.Arg(cst.SimpleString("'cuda'"), comma=comma), cst.Arg(tr.device)]
            )
            return device_call, Device(DeviceKind.LITERAL, "cuda")
        dev_kind = classify_device(self, tr.device)
        if not dev_kind.is_device or may_be_int(self, tr.device):
            self.report(
                node,
                fmt={"factory": factory, "x": source(self, tr.device)},
                message="`{factory}(...).cuda({x})`: the type of `{x}` is not known; pass "
                "`device=torch.device('cuda', {x})` if it is a GPU index, or "
                "`device={x}` if it is a device",
            )
            return None
        return tr.device, dev_kind

    def _to_target(self, node: cst.Call, tr: TrailingCall, factory: str) -> tuple[cst.BaseExpression, Device] | None:
        """The ``device=`` expression for ``.to(x)`` and what it names; None (reported) when ``x``
        may be a dtype or a tensor and the signature does not say it is a device."""
        assert tr.device is not None  # (a `.to` without a device is TOP102's)
        dev_kind = classify_device(self, tr.device)
        if not dev_kind.is_device and not tr.forced:
            self.report(
                node,
                fmt={"factory": factory, "x": source(self, tr.device)},
                message="`{factory}(...).to({x})`: `{x}` may be a device, a dtype or a tensor; "
                "if it is a device, pass `device={x}` to the factory",
            )
            return None
        return tr.device, dev_kind

    def _message_fields(
        self,
        kind: str,
        factory: str,
        tr: TrailingCall,
        ref: TorchRef | None,
        dev_expr: cst.BaseExpression,
        dev_kind: Device,
    ) -> dict[str, str]:
        """The placeholders of the message and fix title: the factory as written, the device, the
        assumption made about it and the factory the fix calls."""
        assumption = ""
        if dev_kind.kind is DeviceKind.CONVENTION and not tr.forced:
            assumption = f" (assuming `{source(self, tr.device or dev_expr)}` is a torch.device)"
        device_text = " ".join(self.ctx.module.code_for_node(dev_expr).split())
        new_name = factory
        if (kind == "from_numpy" or kind in LEGACY) and ref is not None:
            new_name = f"{ref.name}.{'as_tensor' if kind == 'from_numpy' else 'empty'}"
        return {"factory": factory, "device": device_text, "assumption": assumption, "new": new_name}

    def _already_there(self, inner: cst.Call, dev_kind: Device) -> bool:
        """The move goes to the CPU the factory already creates on: ``.to('cpu')`` returns the same
        tensor, so nothing about its values changes."""
        target_cpu = dev_kind.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and dev_kind.is_cpu
        existing = keyword(inner, "device")
        if existing is None:
            return target_cpu
        ex = classify_device(self, existing.value)
        return target_cpu and ex.kind in (DeviceKind.LITERAL, DeviceKind.KNOWN) and ex.is_cpu

    def _device_tags(
        self, kind: str, inner: cst.Call, dev_kind: Device, same_device: bool
    ) -> tuple[list[Tag], list[str]]:
        """What creating the values on the device changes: random draws come from its generator,
        computed factories from its kernels."""
        tags: list[Tag] = []
        notes: list[str] = []
        if same_device:
            return tags, notes
        where = "the device" if not dev_kind.text else f"`{dev_kind.text}`"
        if kind in RANDOM:
            tags.append(Tag.RNG)
            notes.append(_NOTE_RNG.format(where=where))
        elif kind in COMPUTED or (kind == "arange" and not arange_exact_on_device(self, inner)):
            tags.append(Tag.TOLERANCE)
            notes.append(_NOTE_TOL)
        return tags, notes

    def _fold_dtype(
        self,
        node: cst.Call,
        kind: str,
        inner: cst.Call,
        dtype: cst.BaseExpression,
        same_device: bool,
        fmt: dict[str, str],
        tags: list[Tag],
        notes: list[str],
    ) -> bool:
        """Fold ``.to(device, dtype)``'s dtype into the factory too, adding what that changes to
        ``tags``/``notes``; False (reported, no fix) when the values would not be the same."""
        if kind in LEGACY or kind == "from_numpy":
            data = Data("host", LEGACY.get(kind)) if kind in LEGACY else Data("host")
        else:
            data = self.data(kind, inner)
        dst = dtype_of(self, dtype)
        verdict = fold_verdict(data, dst)
        if not verdict.ok:
            self.report(
                node,
                fmt={**fmt, "why": verdict.reason},
                message="`{factory}(...)` is created on the host, then moved to `{device}`"
                "{assumption}; not fixed: the dtype cannot be folded ({why})",
            )
            return False
        for t in verdict.tags:
            if t not in tags:
                tags.append(t)
                notes.append(verdict.reason)
        cast_is_noop = same_device and data.src is not None and data.src == dst
        if not cast_is_noop and self.requires_grad(inner) and Tag.SEMANTICS not in tags:
            tags.append(Tag.SEMANTICS)
            notes.append(_NOTE_LEAF)
        return True

    def _is_tensor_data(self, call: cst.Call) -> bool:
        pos = positional(call)
        return bool(pos) and isinstance(pos[0].value, cst.Name) and is_tensor_name(self, pos[0].value)

    # ---- torch.cuda.FloatTensor(2, 3) -------------------------------------------------------

    def _bare_cuda_ctor(self, node: cst.Call, ctor: str) -> None:
        if (
            not node.args
            or has_star(node)
            or any(a.keyword is not None or int_value(a.value) is None for a in node.args)
        ):
            return
        factory = source(self, node.func)
        ref = self.ref_at(node)
        fmt = {"factory": factory, "device": "'cuda'", "assumption": "", "new": factory}
        msg = "`{factory}(...)` is a legacy CUDA constructor"
        if ref is None or has_comments(node.func):
            self.report(node, fmt=fmt, message=msg)
            return
        new = node.with_changes(func=ref.attr("empty"))
        new = set_kwarg(new, "dtype", ref.attr(SPELLING[CUDA_LEGACY[ctor]]))
        new = set_kwarg(new, "device", cst.SimpleString("'cuda'"))
        self.report(
            node,
            fmt={**fmt, "new": f"{ref.name}.empty"},
            message=msg,
            replacement=new,
            imports=ref.imports,
            fix_title="Use `{new}(..., dtype=..., device={device})`",
        )
