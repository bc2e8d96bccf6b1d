"""TOP201 `deprecated-amp-api`: migrates the deprecated `torch.cuda.amp.*` and `torch.cpu.amp.*` API
to `torch.amp`, passing the device each call now needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from libcst.metadata import ScopeProvider
import libcst as cst

from torchopt.analysis.arguments import has_star
from torchopt.analysis.arguments import make_kwarg
from torchopt.analysis.names import torch_name
from torchopt.analysis.names import torch_ref
from torchopt.analysis.syntax import source
from torchopt.codemods.amp import FAMILY
from torchopt.codemods.amp import prechecks
from torchopt.codemods.amp.amp_api import (
    AMP_MODULES,
    MEMBERS,
    NEW_ATTR,
    _Edits,
    _Site,
    _alias_list,
    _one_line,
    deprecated_member,
    migrate_call,
    quote_style,
    use_kind,
)
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.rule import Invalid
from torchopt.rewrite.rule import Replacement
from torchopt.rewrite.rule import Rule
from torchopt.rewrite.rule import Safety
from torchopt.rewrite.rule import Valid


@dataclass
class _ImportUses:
    """One deprecated `from ... import` sorted: the uses to migrate, why they cannot be, and the
    aliases that stay in the old import or move to `torch.amp`."""

    sites: list[_Site] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    stay: list[cst.ImportAlias] = field(default_factory=list)
    move: list[cst.ImportAlias] = field(default_factory=list)


class DeprecatedAmpApi(Rule):
    """## What it does
    Migrates the deprecated `torch.cuda.amp.*` and `torch.cpu.amp.*` API to `torch.amp`:

    * `torch.cuda.amp.autocast(...)` → `torch.autocast("cuda", ...)` and
      `torch.cpu.amp.autocast(...)` → `torch.autocast("cpu", ...)`, with every positional argument
      turned into its keyword (`enabled=`, `dtype=`, `cache_enabled=`);
    * `torch.cuda.amp.GradScaler(...)` → `torch.amp.GradScaler("cuda", ...)` (and `"cpu"`);
    * `@torch.cuda.amp.custom_fwd[(cast_inputs=...)]` / `@torch.cuda.amp.custom_bwd` →
      `@torch.amp.custom_fwd(device_type="cuda"[, cast_inputs=...])` / `@torch.amp.custom_bwd(device_type="cuda")`;
    * the decorator `@torch.cuda.amp.autocast()` → `@torch.autocast("cuda")`;
    * `isinstance(x, torch.cuda.amp.GradScaler)` and annotations → `torch.amp.GradScaler`.

    Names imported with `from torch.cuda.amp import autocast, GradScaler` are migrated together:
    the import becomes `from torch.amp import autocast, GradScaler` and every call site gains the
    device (`autocast("cuda")`, `GradScaler("cuda")`) in one edit. Names are resolved by
    qualified name, so `import torch.cuda.amp as amp; amp.GradScaler()` and `import torch as T`
    are recognised, and the file's own torch alias is reused (`T.autocast("cuda")`). The device
    string follows the file's quote style.

    ## Why is this slow
    It is not slower, it is on its way out: every one of these calls emits a `FutureWarning` in
    torch 2.x (`torch.cuda.amp.autocast(args...)` is deprecated...) and they will be removed.
    `torch.amp` is the device-generic API that the other AMP rules generate.

    ## Example
    ```python
    import torch

    scaler = torch.cuda.amp.GradScaler()
    with torch.cuda.amp.autocast(use_amp):
        loss = model(x)
    ```

    ## Use instead
    ```python
    import torch

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(x)
    ```

    ## Fix safety
    Safe and exact: the deprecated classes are thin subclasses that call the `torch.amp` ones with
    the device filled in, and the defaults are the same — `torch.autocast("cuda")` computes in
    float16 and `torch.autocast("cpu")` in bfloat16 (`torch.get_autocast_dtype`), and
    `cache_enabled=None` means the global default, which is `True` as before (a program that
    turned the cache off with `torch.set_autocast_cache_enabled(False)` now keeps it off inside
    the region too; the cache only reuses casts of the same weights, so the values are the same).
    Both forms work under TorchScript.

    Positional arguments of `autocast` always become keywords: the old signature is
    `(enabled, dtype, cache_enabled)` and the new one `(device_type, dtype, enabled, cache_enabled)`,
    so `torch.autocast("cuda", use_amp)` would put the bool into `dtype` and fail on `__enter__`
    (`TypeError: ... must be torch.dtype, not bool`). `GradScaler` keeps its positional
    arguments: its new parameter list is the old one shifted by `device`.

    `isinstance` checks and annotations are migrated too: an object built by
    `torch.amp.GradScaler(...)` is *not* an instance of `torch.cuda.amp.GradScaler`, while the old
    class is a subclass of the new one, so the new check accepts both.

    Imported names that `torch.amp` lacks, and module-level imported names the file does not use
    (another module may import them from here and call them without a device), stay in a
    `from torch.cuda.amp import ...` line of their own; only the names used here move.

    Not fixed (reported with advice): a deprecated name used as a value
    (`ctx = autocast if amp else nullcontext`, `partial(autocast, ...)`) — then its import and its
    other uses are left alone too; calls with `*args`/`**kwargs`; a star import. A name also bound
    by another statement (`try: from torch.amp import autocast` / `except ImportError: from
    torch.cuda.amp import autocast`) is left alone without a report.
    """

    code = "TOP201"
    min_torch = (2, 3)  # `torch.amp.GradScaler(device)`
    locality = "file"  # an import's fix depends on every use of the names it binds
    name = "deprecated-amp-api"
    family = FAMILY
    message = "`{old}` is deprecated (FutureWarning); use `{new}`"
    import_message = "`{old}` imports the deprecated AMP API; import from `torch.amp` and pass the device"
    value_message = (
        "`{old}` is deprecated, and used here as a value, so the device argument cannot be added: "
        "use `{new}` (e.g. `functools.partial({new}, {device})`) by hand"
    )
    manual_message = "`{old}` is deprecated (FutureWarning); migrate it to `{new}` by hand ({why})"
    fix_title = "Use `{new}`"
    safety = Safety.SAFE
    # "cuda import": `from torch.cuda import nccl, amp` / `from torch.cuda import (amp)`.
    prefilter = ("cuda.amp", "cpu.amp", "cuda import", "cpu import")

    @classmethod
    def could_match(cls, text: str) -> bool:
        return super().could_match(text) and prechecks.deprecated_amp_possible(text)

    examples = (
        Invalid(
            "import torch\n\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast():\n    y = a @ a\n",
            after='import torch\n\na = torch.randn(4, 4)\nwith torch.autocast("cpu"):\n    y = a @ a\n',
            runnable=True,
        ),
        Invalid(
            "import torch\n\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast(True, torch.float16):\n    y = a @ a\n",
            after="import torch\n\na = torch.randn(4, 4)\n"
            'with torch.autocast("cpu", enabled=True, dtype=torch.float16):\n    y = a @ a\n',
            runnable=True,
            note="positional arguments become keywords (else `enabled` would land in `dtype`)",
        ),
        Invalid(
            "import torch\n\nuse_amp = False\na = torch.randn(4, 4)\nwith torch.cpu.amp.autocast(use_amp):\n    y = a @ a\n",
            after="import torch\n\nuse_amp = False\na = torch.randn(4, 4)\n"
            'with torch.autocast("cpu", enabled=use_amp):\n    y = a @ a\n',
            runnable=True,
            note='`torch.autocast("cpu", use_amp)` would raise on entry',
        ),
        Invalid(
            "import torch\n\ndef step(model, x, use_amp):\n"
            "    with torch.cuda.amp.autocast(enabled=use_amp, dtype=torch.float16, cache_enabled=False):\n"
            "        return model(x)\n",
            after='import torch\n\ndef step(model, x, use_amp):\n    with torch.autocast(\n        "cuda", enabled=use_amp, dtype=torch.float16, cache_enabled=False\n    ):\n        return model(x)\n',
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler()\nloss = torch.ones(()) * 3\n"
            "scaled = scaler.scale(loss)\n",
            after='import torch\n\nscaler = torch.amp.GradScaler("cuda")\nloss = torch.ones(()) * 3\n'
            "scaled = scaler.scale(loss)\n",
            runnable=True,
            note="disabled without CUDA, before and after",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler(2.0 ** 10, 2.0, enabled=False)\n",
            after='import torch\n\nscaler = torch.amp.GradScaler("cuda", 2.0 ** 10, 2.0, enabled=False)\n',
            runnable=True,
            note="GradScaler's positional arguments shift by one and stay",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cpu.amp.GradScaler(init_scale=4.0)\n"
            "loss = torch.ones(()) * 3\nscaled = scaler.scale(loss)\n",
            after='import torch\n\nscaler = torch.amp.GradScaler("cpu", init_scale=4.0)\n'
            "loss = torch.ones(()) * 3\nscaled = scaler.scale(loss)\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\nclass Mul(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_fwd\n    def forward(ctx, x):\n        return x * 2\n\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_bwd\n    def backward(ctx, g):\n        return g * 2\n\n\n"
            "x = torch.ones(3, requires_grad=True)\nMul.apply(x).sum().backward()\ngrad = x.grad\n",
            after="import torch\n\n\nclass Mul(torch.autograd.Function):\n"
            '    @staticmethod\n    @torch.amp.custom_fwd(device_type="cuda")\n    def forward(ctx, x):\n        return x * 2\n\n'
            '    @staticmethod\n    @torch.amp.custom_bwd(device_type="cuda")\n    def backward(ctx, g):\n        return g * 2\n\n\n'
            "x = torch.ones(3, requires_grad=True)\nMul.apply(x).sum().backward()\ngrad = x.grad\n",
            runnable=True,
        ),
        Invalid(
            "import torch\n\n\nclass Exp(torch.autograd.Function):\n"
            "    @staticmethod\n    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)\n"
            "    def forward(ctx, x):\n        y = x.exp()\n        ctx.save_for_backward(y)\n        return y\n",
            after="import torch\n\n\nclass Exp(torch.autograd.Function):\n"
            '    @staticmethod\n    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)\n'
            "    def forward(ctx, x):\n        y = x.exp()\n        ctx.save_for_backward(y)\n        return y\n",
        ),
        Invalid(
            "import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n"
            "    @torch.cuda.amp.autocast()\n    def forward(self, x):\n        return x * 2\n",
            after="import torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n"
            '    @torch.autocast("cuda")\n    def forward(self, x):\n        return x * 2\n',
        ),
        Invalid(
            "import torch\nfrom torch.cuda.amp import autocast, GradScaler\n\n"
            "scaler = GradScaler()\n\ndef step(model, x):\n    with autocast():\n        return model(x)\n",
            after="import torch\nfrom torch.amp import autocast, GradScaler\n\n"
            'scaler = GradScaler("cuda")\n\ndef step(model, x):\n    with autocast("cuda"):\n        return model(x)\n',
            note="the import and every call site change together",
        ),
        Invalid(
            "from torch.cpu.amp import autocast as cpu_autocast\nimport torch\n\na = torch.randn(4, 4)\n"
            "with cpu_autocast(dtype=torch.bfloat16):\n    y = a @ a\n",
            after="from torch.amp import autocast as cpu_autocast\nimport torch\n\na = torch.randn(4, 4)\n"
            'with cpu_autocast("cpu", dtype=torch.bfloat16):\n    y = a @ a\n',
            runnable=True,
        ),
        Invalid(
            "import torch.cuda.amp as amp\n\nscaler = amp.GradScaler()\n",
            after='import torch\nimport torch.cuda.amp as amp\n\nscaler = torch.amp.GradScaler("cuda")\n',
            note="resolved by qualified name; `import torch` is added",
        ),
        Invalid(
            "import torch as T\n\nwith T.cuda.amp.autocast(False):\n    pass\n",
            after='import torch as T\n\nwith T.autocast("cuda", enabled=False):\n    pass\n',
            runnable=True,
            note="the file's alias is reused",
        ),
        Invalid(
            "import torch\n\nscaler = torch.cuda.amp.GradScaler(enabled=False)\n\n\n"
            "def save(s: torch.cuda.amp.GradScaler) -> dict:\n    return s.state_dict()\n\n\n"
            "ok = isinstance(scaler, torch.cuda.amp.GradScaler)\n",
            after='import torch\n\nscaler = torch.amp.GradScaler("cuda", enabled=False)\n\n\n'
            "def save(s: torch.amp.GradScaler) -> dict:\n    return s.state_dict()\n\n\n"
            "ok = isinstance(scaler, torch.amp.GradScaler)\n",
            runnable=True,
            note="isinstance and annotations move with the constructor",
        ),
        Invalid(
            "import torch\n\nmode = 'fast'\nwith torch.cuda.amp.autocast(enabled=mode == 'fast'):\n    pass\n",
            after="import torch\n\nmode = 'fast'\nwith torch.autocast('cuda', enabled=mode == 'fast'):\n    pass\n",
            note="the file's quote style is kept",
        ),
        Invalid(
            "import torch\n\nwith torch.cuda.amp.autocast(\n    enabled=True,\n    dtype=torch.float16,\n):\n    pass\n",
            after='import torch\n\nwith torch.autocast(\n    "cuda",\n    enabled=True,\n    dtype=torch.float16,\n):\n    pass\n',
        ),
        Invalid(
            "import torch\nfrom contextlib import nullcontext\nfrom torch.cuda.amp import autocast\n\n"
            "def ctx(use_amp):\n    return autocast if use_amp else nullcontext\n\nwith autocast():\n    pass\n",
            after=None,
            note="a value use: the device cannot be added, so nothing is rewritten",
        ),
        Invalid(
            "import functools\nimport torch\n\nctx = functools.partial(torch.cuda.amp.autocast, dtype=torch.float16)\n",
            after=None,
        ),
        Invalid(
            "import torch\n\ndef run(kwargs):\n    with torch.cuda.amp.autocast(**kwargs):\n        pass\n",
            after=None,
            note="`**kwargs` cannot be mapped",
        ),
        Valid('import torch\n\nwith torch.autocast("cuda"):\n    pass\n', runnable=True),
        Valid('import torch\n\nscaler = torch.amp.GradScaler("cuda")\n', runnable=True),
        Valid(
            'import torch\n\na = torch.randn(4, 4)\nwith torch.autocast("cpu", dtype=torch.bfloat16):\n    y = a @ a\n',
            runnable=True,
        ),
        Valid(
            'from torch.amp import autocast, GradScaler\n\nscaler = GradScaler("cuda")\nwith autocast("cuda"):\n    pass\n'
        ),
        Valid("def f(torch):\n    return torch.cuda.amp.autocast()\n", note="a parameter named `torch`"),
        Valid(
            "import torch\n\nclass Sub(torch.amp.GradScaler):\n    pass\n\nok = isinstance(Sub(), torch.amp.GradScaler)\n"
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._imports: list[cst.ImportFrom] = []

    # ---- attribute forms: `torch.cuda.amp.X`, `T.cpu.amp.X`, `amp.X`: one finding per node

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value not in MEMBERS:
            return
        dep = deprecated_member(torch_name(self, node))
        if dep is None:
            return
        module, device, member = dep
        site = self._site(node, module, device, member, self._new_ref(node, member))
        self._report_site(site)

    def _new_ref(self, node: cst.Attribute, member: str) -> tuple[cst.BaseExpression, tuple[ImportSpec, ...]] | None:
        """`<torch>.autocast` / `<torch>.amp.X`, reusing the root of `<torch>.cuda.amp.X`."""
        amp = node.value
        if (
            isinstance(amp, cst.Attribute)
            and amp.attr.value == "amp"
            and isinstance(amp.value, cst.Attribute)
            and amp.value.attr.value in ("cuda", "cpu")
            and isinstance(amp.value.value, cst.Name)
        ):
            return cst.parse_expression(f"{amp.value.value.value}.{NEW_ATTR[member]}"), ()
        ref = torch_ref(self)
        if ref is None:
            return None
        return ref.attr(NEW_ATTR[member]), ref.imports

    def _site(
        self,
        ref: cst.BaseExpression,
        module: str,
        device: str,
        member: str,
        new_ref: tuple[cst.BaseExpression, tuple[ImportSpec, ...]] | None,
        keep_name: bool = False,
    ) -> _Site:
        """What to do with one reference. ``keep_name``: the reference itself stays (a from-import
        that is migrated as a whole); else it is replaced by ``new_ref``."""
        q = quote_style(self.ctx.module)
        kind, holder = use_kind(self, ref)
        if keep_name:
            func: cst.BaseExpression = ref
            imports: tuple[ImportSpec, ...] = ()
        elif new_ref is None:
            return _Site(ref, source(self, ref), f"torch.{NEW_ATTR[member]}", problem="`torch` is shadowed here")
        else:
            func, imports = new_ref
        func_code = cst.Module([]).code_for_node(func)
        torch_code = f"torch.{NEW_ATTR[member]}" if keep_name else func_code
        if kind == "call":
            call = holder
            assert isinstance(call, cst.Call)
            old = source(self, call)
            new = migrate_call(call, func, device, member, q)
            if new is None:
                why = "`*args`/`**kwargs` cannot be mapped" if has_star(call) else "unexpected arguments"
                return _Site(call, old, _one_line(f"{torch_code}({q}{device}{q}, ...)"), problem=why)
            manual = migrate_call(call, cst.parse_expression(torch_code), device, member, q)
            return _Site(
                call,
                old,
                _one_line(cst.Module([]).code_for_node(new)),
                edit=lambda upd, f=func: migrate_call(upd, f, device, member, q),  # type: ignore[arg-type, misc]  # upd is this call rewritten, whose arguments migrate_call mapped above
                imports=imports,
                manual=_one_line(cst.Module([]).code_for_node(manual or new)),
            )
        if kind == "decorator" and member in ("custom_fwd", "custom_bwd"):
            new_dec = cst.Call(func=func, args=[make_kwarg("device_type", cst.SimpleString(f"{q}{device}{q}"))])
            manual_dec = new_dec.with_changes(func=cst.parse_expression(torch_code))
            return _Site(
                ref,
                source(self, ref),
                _one_line(cst.Module([]).code_for_node(new_dec)),
                edit=lambda upd: new_dec,
                imports=imports,
                manual=_one_line(cst.Module([]).code_for_node(manual_dec)),
            )
        if kind == "type" and member in ("GradScaler", "autocast"):
            new_code = cst.Module([]).code_for_node(func)
            if keep_name:
                return _Site(ref, source(self, ref), new_code)  # the import change covers it
            return _Site(ref, source(self, ref), new_code, edit=lambda upd: func, imports=imports)
        return _Site(
            ref,
            source(self, ref),
            torch_code,
            problem="value",
            message=self.value_message.format(old=source(self, ref), new=torch_code, device=f"{q}{device}{q}"),
        )

    def _report_site(self, site: _Site) -> None:
        if site.problem == "value":
            self.report(site.node, message=site.message)
        elif site.problem:
            self.report(
                site.node, message=self.manual_message, fmt={"old": site.old, "new": site.new, "why": site.problem}
            )
        elif site.edit is not None:
            target = site.node
            self.report(
                site.node,
                fmt={"old": site.old, "new": site.new},
                replacement=site.edit(target),
                target=target,
                imports=site.imports,
            )

    # ---- `from torch.cuda.amp import autocast, GradScaler`: the import and all its uses at once

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None:
            return
        mod = cst.helpers.get_full_name_for_node(node.module)
        if mod in AMP_MODULES:
            self._imports.append(node)

    def leave_Module(self, original_node: cst.Module) -> None:
        for imp in self._imports:
            self._import_group(imp)

    def _import_group(self, imp: cst.ImportFrom) -> None:
        """Move the names of one `from torch.cuda.amp import ...` to `torch.amp`, together with every
        use of them (each needs the device), or report why it is left as is."""
        mod = (cst.helpers.get_full_name_for_node(imp.module) if imp.module is not None else None) or ""
        old_import = _one_line(self.ctx.module.code_for_node(imp))
        if isinstance(imp.names, cst.ImportStar):
            self.report(
                imp,
                message=self.manual_message,
                fmt={"old": old_import, "new": "from torch.amp import ...", "why": "a star import"},
            )
            return
        try:
            scope = self.get_metadata(ScopeProvider, imp)
        except KeyError:
            scope = None
        if scope is None:
            return
        uses = self._import_uses(imp, imp.names, mod, scope)
        if not uses.sites:
            return  # nothing here uses the old API (or only through another binding too)
        if uses.blocked or any(s.problem for s in uses.sites):
            self._refuse_import(imp, old_import, uses)
            return
        new_imp, edits, nodes = self._import_edit(imp, imp.names, uses)
        for s in uses.sites:
            if s.edit is not None:
                edits[id(s.node)] = s.edit
                nodes.append(s.node)
        target = self._common_ancestor(nodes)
        replacement = target.visit(_Edits(edits))
        new_import = _one_line(cst.Module([]).code_for_node(new_imp))
        self.report(
            imp,
            message=self.import_message,
            fmt={"old": old_import, "new": new_import},
            fix_title=f"Use `{new_import}` and pass the device at every call",
            replacement=replacement,
            target=target,
        )
        for s in uses.sites:
            if s.edit is not None:
                self.report(s.node, fmt={"old": s.old, "new": s.new}, replacement=replacement, target=target)

    def _import_uses(
        self, imp: cst.ImportFrom, aliases: Sequence[cst.ImportAlias], mod: str, scope: cst.metadata.Scope
    ) -> _ImportUses:
        """Sort the imported names into those that move and those that stay, and find every use of
        the moving ones in the file (each becomes a site that gains the device)."""
        device, offered = AMP_MODULES[mod]
        uses = _ImportUses()
        for alias in aliases:
            name = alias.name.value if isinstance(alias.name, cst.Name) else ""
            bound = alias.evaluated_alias or name
            refs: list[cst.metadata.Access] = []
            for a in scope.assignments[bound] if bound in scope.assignments else ():
                if getattr(a, "node", None) is imp:
                    refs.extend(a.references)
            # Names torch.amp lacks stay in the old import, and so do module-level names this file
            # does not use: another module may import them from here and call them without a device.
            if name not in offered or (not refs and isinstance(scope, cst.metadata.GlobalScope)):
                uses.stay.append(alias)
                continue
            uses.move.append(alias)
            for access in refs:
                ref = access.node
                if not isinstance(ref, cst.Name):
                    continue  # a string annotation: still names the right class after the import changes
                if len(access.referents) > 1:
                    uses.blocked.append(f"`{bound}` is also bound by another statement")
                    continue
                uses.sites.append(self._site(ref, mod, device, name, None, keep_name=True))
        return uses

    def _refuse_import(self, imp: cst.ImportFrom, old_import: str, uses: _ImportUses) -> None:
        """Report each use for a manual migration: changing the import alone would break the uses
        that cannot be migrated, or a name bound by another statement too."""
        why = "; ".join(dict.fromkeys(uses.blocked)) or "a use below cannot be migrated"
        for s in uses.sites:
            if s.problem:
                self._report_site(s)
            elif s.edit is not None:
                self.report(
                    s.node, message=self.manual_message, fmt={"old": s.old, "new": s.manual or s.new, "why": why}
                )
        if uses.blocked:
            self.report(
                imp,
                message=self.manual_message,
                fmt={"old": old_import, "new": "from torch.amp import ...", "why": why},
            )

    def _import_edit(
        self, imp: cst.ImportFrom, aliases: Sequence[cst.ImportAlias], uses: _ImportUses
    ) -> tuple[cst.ImportFrom, dict[int, Callable[[cst.CSTNode], Replacement]], list[cst.CSTNode]]:
        """The new `from torch.amp import ...`, the edit that puts it in place of ``imp`` (split in two
        when some names stay in the old module), and the nodes that edit touches."""
        new_module = cst.Attribute(value=cst.Name("torch"), attr=cst.Name("amp"))
        edits: dict[int, Callable[[cst.CSTNode], Replacement]] = {}
        nodes: list[cst.CSTNode] = []
        if not uses.stay:
            new_imp = imp.with_changes(module=new_module)
            edits[id(imp)] = lambda upd: upd.with_changes(module=new_module)
            nodes.append(imp)
            return new_imp, edits, nodes
        # Split: `from torch.cuda.amp import <stay>` then `from torch.amp import <move>`.
        kept = imp.with_changes(names=_alias_list(uses.stay, aliases), lpar=imp.lpar, rpar=imp.rpar)
        new_imp = imp.with_changes(module=new_module, names=_alias_list(uses.move, aliases))
        line = self.get_metadata(ParentProvider, imp, None)
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
            pair = cst.FlattenSentinel(
                [line.with_changes(body=[kept]), cst.SimpleStatementLine(body=[new_imp], leading_lines=[])]
            )
            edits[id(line)] = lambda upd: pair
            holder = self.get_metadata(ParentProvider, line, None)
            nodes.append(holder if holder is not None else line)
        else:
            semi = cst.FlattenSentinel(
                [kept.with_changes(semicolon=cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" "))), new_imp]
            )
            edits[id(imp)] = lambda upd: semi
            nodes.append(line if line is not None else imp)
        return new_imp, edits, nodes

    def _common_ancestor(self, nodes: list[cst.CSTNode]) -> cst.CSTNode:
        def chain(n: cst.CSTNode) -> list[cst.CSTNode]:
            out = [n]
            while True:
                p = self.get_metadata(ParentProvider, out[-1], None)
                if p is None:
                    return out[::-1]
                out.append(p)

        chains = [chain(n) for n in nodes]
        common = chains[0][0]
        for level in zip(*chains):
            if all(x is level[0] for x in level):
                common = level[0]
            else:
                break
        return common
