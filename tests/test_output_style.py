"""Rewritten code follows the project's formatter settings: lines a fix made too long are wrapped as
ruff format wraps them, new imports sit in their isort section at their sorted place, inserted
strings take the project's quotes, and nothing the fix did not touch is reformatted. Where ruff is
installed (the dev extra), its own verdict is the judge: a file ruff accepted before the rewrite, it
accepts after."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from textwrap import dedent

import pytest

from torchopt.rewrite.config import Resolver, Settings
from torchopt.rewrite.engine import fix_source
from torchopt.rewrite.imports import add_imports
from torchopt.rewrite.rule import ImportSpec
from torchopt.rewrite.style import Style
from torchopt.rewrite.wrap import Wrapper

RUFF = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
needs_ruff = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[dev]')")


def _fix(src: str, code: str, style: Style = Style(), unsafe: bool = True) -> str:
    return fix_source(src, replace(Settings(select=(code,)), style=style), unsafe=unsafe).text


def _ruff_rejects(tmp: Path, text: str, *args: str) -> list[str]:
    """What ``ruff format --check`` and ``ruff check --select I,E501`` say against ``text`` (empty
    when both accept it), with the formatter's defaults or ``args``."""
    assert RUFF is not None
    path = tmp / "case.py"
    path.write_text(text, encoding="utf-8")
    problems = []
    for cmd in (["format", "--check", "--diff"], ["check", "--select", "I,E501", "--output-format", "concise"]):
        run = subprocess.run([RUFF, *cmd, "--isolated", "--no-cache", *args, str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            problems.append(run.stdout + run.stderr)
    return problems


LOADER = dedent("""\
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def make_loader(features):
        ds = TensorDataset(features, torch.arange(len(features)))
        return DataLoader(ds, batch_size=64, shuffle=True)
""")

LOADER_FIXED = dedent("""\
    import os

    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def make_loader(features):
        ds = TensorDataset(features, torch.arange(len(features)))
        return DataLoader(
            ds, batch_size=64, shuffle=True, num_workers=min(8, os.cpu_count() or 1)
        )
""")


def test_a_new_standard_library_import_gets_its_own_section_and_the_long_call_is_wrapped():
    assert _fix(LOADER, "TOP701") == LOADER_FIXED


def test_the_configured_line_length_keeps_the_call_on_one_line():
    out = _fix(LOADER, "TOP701", Style(line_length=100))
    assert "    return DataLoader(ds, batch_size=64, shuffle=True, num_workers=min(8, os.cpu_count() or 1))\n" in out


@needs_ruff
def test_ruff_accepts_the_rewrite_of_a_file_it_accepted(tmp_path):
    assert _ruff_rejects(tmp_path, LOADER) == []
    assert _ruff_rejects(tmp_path, _fix(LOADER, "TOP701")) == []


def test_a_new_import_goes_to_its_sorted_place_in_the_standard_library_block():
    src = dedent("""\
        import math
        import sys

        import torch
        from torch.utils.data import DataLoader


        def make_loader(ds):
            return DataLoader(ds, batch_size=math.prod((4, 2)))
    """)
    out = _fix(src, "TOP701")
    assert out.startswith(
        "import math\nimport os\nimport sys\n\nimport torch\nfrom torch.utils.data import DataLoader\n"
    )


def test_straight_imports_come_before_from_imports_in_a_section():
    # ruff's isort defaults (force-sort-within-sections = false): `import x` first, then `from x import y`
    import libcst as cst

    src = "from os import path\nimport sys\n\nimport torch\n\nx = 1\n"
    out = add_imports(cst.parse_module(src), [ImportSpec("os")], Style()).code
    assert out == "import os\nfrom os import path\nimport sys\n\nimport torch\n\nx = 1\n" or out.startswith(
        "import os\n"
    )
    src = "import sys\nfrom os import path\n\nimport torch\n\nx = 1\n"
    out = add_imports(cst.parse_module(src), [ImportSpec("os")], Style()).code
    assert out == "import os\nimport sys\nfrom os import path\n\nimport torch\n\nx = 1\n"


def test_a_name_from_a_module_already_imported_from_joins_that_import_in_member_order():
    import libcst as cst

    src = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nfrom torch.nn.utils import clip_grad_norm_\n"
    out = add_imports(cst.parse_module(src), [ImportSpec("torch.nn.utils", "parameters_to_vector")], Style()).code
    assert out.endswith("from torch.nn.utils import clip_grad_norm_, parameters_to_vector\n")
    out = add_imports(cst.parse_module(src), [ImportSpec("torch.nn.modules.utils", "consume")], Style()).code
    assert out == (
        "import torch\nfrom torch.nn.modules.utils import consume\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\nfrom torch.nn.utils import clip_grad_norm_\n"
    )


def test_first_party_modules_named_in_the_config_form_their_own_section():
    import libcst as cst

    src = "import os\n\nimport numpy\n\nimport mylib\n\nx = 1\n"
    out = add_imports(cst.parse_module(src), [ImportSpec("torch")], Style(known_first_party=("mylib",))).code
    assert out == "import os\n\nimport numpy\nimport torch\n\nimport mylib\n\nx = 1\n"


MODULE_MOVE = "import torch.nn as nn\n\nlayer = nn.Linear(4, 3).cuda()\n"


def test_inserted_strings_take_the_double_quotes_of_the_default_style():
    assert _fix(MODULE_MOVE, "TOP103") == 'import torch.nn as nn\n\nlayer = nn.Linear(4, 3, device="cuda")\n'


def test_inserted_strings_take_the_configured_quote():
    assert _fix(MODULE_MOVE, "TOP103", Style(quote="single")).endswith("device='cuda')\n")


def test_without_a_configured_quote_inserted_strings_take_the_files_own():
    src = "import torch.nn as nn\n\nname = 'a'\nlayer = nn.Linear(4, 3).cuda()\n"
    assert _fix(src, "TOP103").endswith("layer = nn.Linear(4, 3, device='cuda')\n")


def test_lines_the_fix_did_not_touch_keep_their_layout_and_quotes():
    long_line = "untouched = {'key': [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}\n"
    src = "import torch.nn as nn\n\n" + long_line + "layer = nn.Linear(4, 3).cuda()\n"
    out = _fix(src, "TOP103", Style(quote="double"))
    assert out == "import torch.nn as nn\n\n" + long_line + 'layer = nn.Linear(4, 3, device="cuda")\n'


def test_a_statement_inserted_after_the_imports_is_separated_from_them():
    src = dedent("""\
        import torch
        import torch.nn as nn

        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(10):
            loss = model(torch.randn(16, 3, 32, 32, device="cuda")).mean()
            loss.backward()
            opt.step()
    """)
    out = _fix(src, "TOP501")
    assert out.startswith("import torch\nimport torch.nn as nn\n\ntorch.backends.cudnn.benchmark = True\n\nmodel = ")


def test_a_new_statements_comment_goes_above_it_rather_than_past_the_margin():
    src = dedent("""\
        import torch
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(nn.Linear(4, 2))
        model.load_state_dict(torch.load("ckpt.pt"))
    """)
    out = _fix(src, "TOP406")
    assert "\n# also load checkpoints saved from the wrapper\nconsume_prefix_in_state_dict_if_present(" in out
    assert max(len(line) for line in out.splitlines()) <= 88
    assert out.startswith(
        "import torch\nimport torch.nn as nn\nfrom torch.nn.modules.utils import consume_prefix_in_state_dict_if_present\n"
    )


def test_the_style_is_read_from_the_projects_formatter_settings(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.ruff]\nline-length = 100\n[tool.ruff.format]\nquote-style = "single"\n'
        'skip-magic-trailing-comma = true\n[tool.ruff.lint.isort]\nknown-first-party = ["mylib"]\n'
    )
    (tmp_path / "pkg").mkdir()
    style = Resolver().for_path(str(tmp_path / "pkg" / "train.py")).style
    assert (style.line_length, style.quote, style.magic_trailing_comma) == (100, "single", False)
    assert style.known_first_party == ("mylib",)
    # a ruff.toml nearer the file wins, as it does for ruff
    (tmp_path / "pkg" / "ruff.toml").write_text("line-length = 79\n")
    assert Resolver().for_path(str(tmp_path / "pkg" / "train.py")).style.line_length == 79


def test_black_and_isort_settings_apply_without_a_ruff_configuration(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        "[tool.black]\nline-length = 99\nskip-string-normalization = true\n"
        '[tool.isort]\nprofile = "black"\nknown_first_party = ["mylib"]\n'
    )
    style = Resolver().for_path(str(tmp_path / "train.py")).style
    assert (style.line_length, style.quote, style.known_first_party) == (99, "preserve", ("mylib",))
    assert Resolver().for_path(str(tmp_path.parent / "elsewhere.py")).style.line_length == 88


# Statements shaped like the ones the fixes write, at two depths; ruff format is the reference.
SHAPES = [
    "loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=min(8, os.cpu_count() or 1))",
    "self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))",
    "self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))",
    "loss = model(images.to(device, memory_format=torch.channels_last)).logsumexp(1).mean()",
    "loss = model(images.to(device, memory_format=torch.channels_last, non_blocking=True)).mean()",
    "images = images.to(device_aaaaaaaaaaaa, non_blocking=True, memory_format=torch.channels_last)",
    "model.load_state_dict(torch.load(checkpoint_path_aaaaaaaaaaaa, map_location='cpu', weights_only=True))",
    "inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)",
    "batch = [t.to(device, non_blocking=True, memory_format=torch.channels_last) for t in batch_aaaaaaaa]",
    "x = torch.zeros(batch_size_aaaaaaaa, channels_bbbbbbbb, device=device) + torch.ones(3, device=device) * 2 + y",
    "torch.testing.assert_close(loss, torch.as_tensor(0.5, dtype=loss.dtype, device=loss.device), rtol=0, atol=1e-6, equal_nan=True, check_dtype=False)",
    "scaler = torch.amp.GradScaler('cuda', enabled=args.amp and torch.cuda.is_available() and not args.cpu_only)",
    "x = {'a': torch.zeros(3, device='cuda'), 'b': torch.ones(4, device='cuda'), 'c': torch.ones(4, device='cuda')}",
    "return torch.log_softmax(self.decoder(output), dim=-1).reshape(-1, self.decoder.out_features), hidden",
    "assert 8 % world_size == 0, 'the global batch size must divide by the number of processes'",
    "with torch.profiler.profile(record_shapes=True, activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:",
    "with torch.autocast('cuda', enabled=use_amp, dtype=torch.float16, cache_enabled=False, extra=1):",
    "with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):",
    "for images, labels in DataLoader(dataset_aaaaaaaa, batch_size=batch_size, shuffle=True, pin_memory=True):",
    "model = DistributedDataParallel(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)",
    "preallocate_for_longest_batch([criterion, model], [optimizer], lambda: collate([data[i] for i in sorted(range(len(data)), key=lambda i: len(data[i][0]))[-2:]]), warmup_loss)",
    "net = nn.Sequential(nn.Linear(32, ((H + 7) // 8) * 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(((H + 7) // 8) * 8, 8))",
    "with contextlib.nullcontext() if sync_grads else getattr(model, 'no_sync', contextlib.nullcontext)():",
    "with (contextlib.nullcontext() if sync_grads else model.no_sync()):",
    "activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA_aaaaaaa]",
    "self.amp_dtype = torch.float16 if self.amp_device_type_aaaaaaaaaa == 'cuda' else torch.bfloat16",
    "amp_dtype = torch.float16 if self.amp_device_type_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa == 'cuda' else bf16",
    "total_loss_aaaaaaaa = reconstruction_loss_aaaaaaaaaaaa + kl_weight_aaaaaaaa * kl_divergence_aaaaa",
    "return reconstruction_loss_aaaaaaaaaaaaaaaaaaaaaaaa + kl_weight_aaaaaaaaaaaaaaaa * kl_divergence_aa",
]


@needs_ruff
def test_long_statements_are_wrapped_as_ruff_format_wraps_them(tmp_path):
    wrapper = Wrapper(88, "    ", magic_trailing_comma=True)
    ours, plain = [], []
    for depth in (1, 3):
        for i, shape in enumerate(SHAPES):
            shape = shape.replace("'", '"')
            head = ["\n\n" if plain else "", f"def case_{depth}_{i}():\n"] + [
                f"{'    ' * k}if x:\n" for k in range(1, depth)
            ]
            body = [f"{'    ' * (depth + 1)}pass\n"] if shape.endswith(":") else []
            plain += head + [f"{'    ' * depth}{shape}\n"] + body
            ours += head + [line + "\n" for line in wrapper.wrap(wrapper.unparen(shape), "    " * depth)] + body
    path = tmp_path / "shapes.py"
    path.write_text("".join(plain))
    subprocess.run([RUFF, "format", "--isolated", "--no-cache", "-q", str(path)], check=True)
    assert "".join(ours) == path.read_text()


def _rejected(folder: Path) -> set[str]:
    """The files of ``folder`` that ``ruff format --check`` or ``ruff check --select I,E501`` reject
    (ruff's defaults: 88 columns, double quotes)."""
    assert RUFF is not None
    out = set()
    for cmd in (["format", "--check"], ["check", "--select", "I,E501", "--output-format", "concise"]):
        run = subprocess.run([RUFF, *cmd, "--isolated", "--no-cache", "."], cwd=folder, capture_output=True, text=True)
        said = run.stdout + run.stderr
        out |= {p.name for p in folder.glob("*.py") if re.search(rf"(^|[\s/]){re.escape(p.name)}(:|\s|$)", said, re.M)}
    return out


@pytest.mark.slow
@needs_ruff
def test_ruff_accepts_every_rewrite_of_a_fixture_or_rule_example_it_accepted(tmp_path):
    """Every fixture and rule example, first put in ruff's style (ruff format, ruff's import sort),
    then rewritten: what ruff accepted before the rewrite, it accepts after."""
    from torchopt.rewrite.registry import all_rules
    from torchopt.rewrite.rule import Invalid

    fixtures = Path(__file__).resolve().parent.parent / "fixtures"
    cases: list[tuple[str, str, tuple[str, ...] | None]] = [
        (d.name, (d / "before.py").read_text(encoding="utf-8"), None)
        for d in sorted(fixtures.iterdir())
        if (d / "before.py").is_file()
    ]
    cases += [
        (f"{code}_{i}", ex.src, (code,))
        for code, rule in all_rules().items()
        for i, ex in enumerate(rule.examples)
        if isinstance(ex, Invalid) and ex.after is not None
    ]
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    for name, src, _ in cases:
        (before / f"{name}.py").write_text(src, encoding="utf-8")
    subprocess.run([RUFF, "check", "--isolated", "--select", "I", "--fix", "-q", "--no-cache", "."], cwd=before)
    subprocess.run([RUFF, "format", "--isolated", "-q", "--no-cache", "."], cwd=before)
    accepted = {p.name for p in before.glob("*.py")} - _rejected(before)
    assert len(accepted) > 150, "the measurement covers too few files"
    for name, _, select in cases:
        if f"{name}.py" not in accepted:
            continue
        src = (before / f"{name}.py").read_text(encoding="utf-8")
        settings = Settings() if select is None else Settings(select=select)
        for unsafe in (False, True) if select is None else (True,):
            (after / f"{name}{'_unsafe' if unsafe else ''}.py").write_text(
                fix_source(src, settings, unsafe=unsafe).text, encoding="utf-8"
            )
    assert sorted(_rejected(after)) == []


EXPLODED = dedent("""\
    import torch
    from torch.utils.data import DataLoader


    def make_loader(ds):
        return DataLoader(
            ds,
            batch_size=64,
        )
""")


def test_a_magic_trailing_comma_keeps_the_call_one_argument_per_line():
    out = _fix(EXPLODED, "TOP701")
    assert (
        "    return DataLoader(\n        ds,\n        batch_size=64,\n        num_workers=min(8, os.cpu_count() or 1),\n    )\n"
        in out
    )


def test_without_the_magic_trailing_comma_a_touched_call_that_fits_is_joined():
    out = _fix(EXPLODED, "TOP701", Style(magic_trailing_comma=False))
    assert "    return DataLoader(ds, batch_size=64, num_workers=min(8, os.cpu_count() or 1))\n" in out


@needs_ruff
def test_ruff_agrees_on_the_trailing_comma_either_way(tmp_path):
    assert _ruff_rejects(tmp_path, _fix(EXPLODED, "TOP701")) == []
    skip = ("--config", "format.skip-magic-trailing-comma = true")
    assert _ruff_rejects(tmp_path, _fix(EXPLODED, "TOP701", Style(magic_trailing_comma=False)), *skip) == []


def test_form_feeds_and_line_separators_do_not_shift_the_lines_laid_out():
    src = "import torch.nn as nn\n\x0c\n# page\u2028break in a comment\nlayer = nn.Linear(4, 3).cuda()\n"
    assert _fix(src, "TOP103") == src.replace("nn.Linear(4, 3).cuda()", 'nn.Linear(4, 3, device="cuda")')
