"""TOP101 through a rearranging chain (``torch.arange(n).unsqueeze(0).repeat(b, 1).to(dev)``) and for
a factory used as an index of a tensor that may be on a device (``x[torch.arange(n), i]``): the
layouts of the third real-world sample's misses, written here in our own words, run before and after
the fix on the CPU; and the forms the fix must leave alone."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
import pytest
import torch

from torchopt.analysis.layout_chains import ast_chain_root, chain_root, replace_root
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source, fix_source

ONLY = Settings(select=("TOP101",))


def _run(src: str, call: str) -> object:
    env: dict = {}
    exec(compile(src, "<src>", "exec"), env)
    return eval(call, env)


def _flat(text: str) -> str:
    """The text without whitespace: a long fixed line is wrapped by the formatter."""
    return "".join(text.split())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride() and torch.equal(a, b)


# --- the fact: which expressions are chains ------------------------------------------------------


@pytest.mark.parametrize(
    "text,links",
    [
        ("torch.arange(n).unsqueeze(0).repeat(b, 1)", ("unsqueeze", "repeat")),
        ("torch.arange(n)[:, None]", ("[]",)),
        ("torch.zeros(3)[None, ...].t().contiguous()", ("[]", "t", "contiguous")),
        ("torch.ones(2, 3).view(3, 2).flip(0)", ("view", "flip")),
    ],
)
def test_chains_are_found_with_their_links(text, links):
    expr = cst.parse_expression(text)
    found = chain_root(expr)
    assert found is not None
    root, got = found
    assert got == links
    assert cst.Module([]).code_for_node(root).startswith("torch.")
    assert isinstance(ast_chain_root(ast.parse(text, mode="eval").body), ast.Call)
    new = cst.parse_expression("torch.zeros(1)")
    assert isinstance(new, cst.Call)
    assert cst.Module([]).code_for_node(replace_root(expr, root, new)).startswith("torch.zeros(1)")


@pytest.mark.parametrize(
    "text",
    [
        "torch.arange(n).expand(2, n)",  # an overlapping view
        "torch.arange(9)[::2]",  # gaps
        "torch.arange(9)[1:]",
        "torch.zeros(3, 3)[0]",
        "torch.arange(n).float()",  # a cast: TOP102's
        "x.unsqueeze(0)",  # no call at the bottom
        "torch.arange(n)",  # no link
    ],
)
def test_other_forms_are_no_chain(text):
    assert chain_root(cst.parse_expression(text)) is None


# --- position ids built at every forward (an encoder and a decoder of a seq2seq model) ----------------

SEQ2SEQ = textwrap.dedent("""\
    import torch
    from torch import nn


    class Encoder(nn.Module):
        def __init__(self, vocab, width, device):
            super().__init__()
            self.device = device
            self.tok = nn.Embedding(vocab, width)
            self.pos = nn.Embedding(64, width)

        def forward(self, src):
            batch_size = src.shape[0]
            src_len = src.shape[1]
            pos = torch.arange(0, src_len).unsqueeze(0).repeat(batch_size, 1).to(self.device)
            return self.tok(src) + self.pos(pos)


    class Decoder(Encoder):
        def forward(self, trg):
            n = trg.shape[1]
            rows = torch.arange(n)[:, None].repeat(1, n).to(self.device)
            return super().forward(trg) + rows.sum()


    def run(device):
        torch.manual_seed(0)
        enc = Encoder(50, 8, device).to(device)
        dec = Decoder(50, 8, device).to(device)
        src = torch.randint(0, 50, (3, 7), device=device)
        return enc(src), dec(src)
""")


def test_position_ids_of_a_forward_are_created_on_the_device():
    found = check_source(SEQ2SEQ, ONLY).diagnostics
    assert len(found) == 2
    assert all("rearranged" in d.message and "self.device" in d.message for d in found)
    out = fix_source(SEQ2SEQ, ONLY, unsafe=False).text
    assert _flat("pos = (torch.arange(0, src_len, device=self.device).unsqueeze(0).repeat(batch_size, 1))") in _flat(
        out
    )
    assert _flat("rows = torch.arange(n, device=self.device)[:, None].repeat(1, n)") in _flat(out)
    assert ".to(self.device)" not in out
    before, after = _run(SEQ2SEQ, "run('cpu')"), _run(out, "run('cpu')")
    assert all(_same(a, b) for a, b in zip(before, after))


# --- an index made on the host at every decoding step -------------------------------------------------

DECODER = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F


    class Greedy:
        def __init__(self, eot):
            self.eot = eot

        def update(self, tokens, logits, sum_logprobs):
            next_tokens = logits.argmax(dim=-1)
            logprobs = F.log_softmax(logits.float(), dim=-1)
            current = logprobs[torch.arange(logprobs.shape[0]), next_tokens]
            sum_logprobs += current * (tokens[:, -1] != self.eot)
            return torch.cat([tokens, next_tokens[:, None]], dim=-1), sum_logprobs


    def run(device):
        torch.manual_seed(0)
        tokens = torch.zeros(4, 1, dtype=torch.long, device=device)
        total = torch.zeros(4, device=device)
        greedy = Greedy(eot=3)
        for _ in range(5):
            tokens, total = greedy.update(tokens, torch.randn(4, 10, device=device), total)
        return tokens, total
""")


def test_a_host_index_of_a_device_tensor_is_created_on_its_device():
    found = check_source(DECODER, ONLY).diagnostics
    assert [d.line for d in found] == [12]
    assert "index the tensor `logprobs`" in found[0].message
    out = fix_source(DECODER, ONLY, unsafe=False).text
    assert _flat("logprobs[torch.arange(logprobs.shape[0], device=logprobs.device), next_tokens]") in _flat(out)
    before, after = _run(DECODER, "run('cpu')"), _run(out, "run('cpu')")
    assert all(_same(a, b) for a, b in zip(before, after))


# --- counter-cases ------------------------------------------------------------------------------------


def test_a_factory_whose_device_is_bound_after_it_is_left_alone():
    src = textwrap.dedent("""\
        import torch

        def f(x, n):
            pos = torch.arange(n).unsqueeze(0)
            device = x.device
            return pos.to(device)
    """)
    assert not check_source(src, ONLY).diagnostics
    assert fix_source(src, ONLY, unsafe=True).text == src


def test_a_move_to_another_tensor_which_also_casts_is_not_rewritten():
    src = textwrap.dedent("""\
        import torch

        def f(x, n):
            return torch.arange(n).unsqueeze(0).repeat(2, 1).to(x)
    """)
    found = check_source(src, ONLY).diagnostics
    assert len(found) == 1 and found[0].fix is None and "a dtype or a tensor" in found[0].message
    assert fix_source(src, ONLY, unsafe=True).text == src
    # Why: `.to(x)` takes x's dtype too; `device=x.device` alone would keep int64.
    naive = src.replace("torch.arange(n)", "torch.arange(n, device=x.device)").replace(".to(x)", "")
    x = torch.zeros(1, dtype=torch.float64)
    assert _run(src, "f")(x, 3).dtype == torch.float64
    assert _run(naive, "f")(x, 3).dtype == torch.int64


def test_an_index_of_a_host_tensor_or_of_an_unknown_value_is_left_alone():
    host = textwrap.dedent("""\
        import torch

        def pick(device):
            t = torch.zeros(5)
            return t[torch.arange(3)], torch.zeros(3).to(device)
    """)
    found = check_source(host, ONLY).diagnostics
    assert [d.line for d in found] == [5] and all("index" not in d.message for d in found)
    unknown = textwrap.dedent("""\
        import torch

        def pick(table, device):
            return table[torch.arange(3)], torch.zeros(3).to(device)
    """)
    found = check_source(unknown, ONLY).diagnostics
    assert [d.line for d in found] == [4] and all("index" not in d.message for d in found)


# --- an index computed on the host through names (relative positions of an attention block) -----------

RELATIVE = textwrap.dedent("""\
    import torch
    import torch.nn.functional as F


    def relative_table(q_size: int, k_size: int, table: torch.Tensor):
        longest = 2 * max(q_size, k_size) - 1
        if table.shape[0] != longest:
            resized = F.interpolate(table.t()[None], size=longest, mode="linear")[0].t()
        else:
            resized = table
        q_coords = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
        k_coords = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
        relative = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
        return resized[relative.long()]


    def run(device):
        torch.manual_seed(0)
        table = torch.randn(13, 4, device=device)
        return [relative_table(q, k, table) for q, k in ((7, 7), (4, 7), (7, 3), (9, 9))]
""")


def test_an_index_computed_through_names_is_computed_on_the_device():
    found = check_source(RELATIVE, ONLY).diagnostics
    assert len(found) == 1 and "`relative`, `q_coords`, `k_coords`" in found[0].message
    assert found[0].fix is not None and found[0].fix.tags == ("tolerance",)
    assert fix_source(RELATIVE, ONLY, unsafe=False).text == RELATIVE
    out = fix_source(RELATIVE, ONLY, unsafe=True).text
    assert _flat("q_coords = torch.arange(q_size, device=resized.device)[:, None]") in _flat(out)
    assert _flat("k_coords = torch.arange(k_size, device=resized.device)[None, :]") in _flat(out)
    before, after = _run(RELATIVE, "run('cpu')"), _run(out, "run('cpu')")
    assert all(_same(a, b) for a, b in zip(before, after))


def test_an_index_whose_tensor_is_bound_after_its_factory_is_not_rewritten():
    src = textwrap.dedent("""\
        import torch

        def pick(n: int, data, device):
            idx = torch.arange(n)
            table = torch.flatten(data.to(device))
            return table[idx]
    """)
    found = check_source(src, ONLY).diagnostics
    assert len(found) == 1 and found[0].fix is None and "bound after the factory" in found[0].message
    assert fix_source(src, ONLY, unsafe=True).text == src
    # Why: `table.device` read at the factory would name nothing yet.
    naive = src.replace("torch.arange(n)", "torch.arange(n, device=table.device)")
    with pytest.raises(UnboundLocalError):
        _run(naive, "pick(3, torch.zeros(4), 'cpu')")
