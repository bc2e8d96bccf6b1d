"""The one statement-editing implementation the rule families share (torchopt.analysis.statement_edits),
and the layout that keeps it the only one: no family defines its own edits, refusal or fresh-name helper,
and the examples of the families that used to splice them are written out whole in their rule."""

from __future__ import annotations

import ast
import os
from textwrap import dedent

import libcst as cst
import pytest

from torchopt.analysis.statement_edits import ApplyEdits, Edits, Refusal, fresh_name, statement, with_statement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODEMODS = os.path.join(ROOT, "torchopt", "codemods")


def _find(module: cst.Module, code: str) -> cst.BaseStatement:
    """The statement of ``module`` (at any depth) whose code is ``code``."""
    for node in _statements(module):
        if module.code_for_node(node.with_changes(leading_lines=())).strip() == code:
            return node
    raise AssertionError(f"no statement {code!r}")


def _statements(node: cst.CSTNode):
    for child in node.children:
        if isinstance(child, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            yield child
        yield from _statements(child)


def _apply(module: cst.Module, edits: Edits) -> str:
    return module.visit(ApplyEdits(edits)).code


# --------------------------------------------------------------------------- fresh names


def test_fresh_name_skips_taken_names_and_reserves_what_it_returns():
    taken = {"scaler", "scaler_1", "rank"}
    assert fresh_name(taken, "scaler") == "scaler_2"
    assert fresh_name(taken, "scaler") == "scaler_3"  # the previous answer is taken now
    assert fresh_name(taken, "world_size") == "world_size"
    assert {"scaler_2", "scaler_3", "world_size"} <= taken


# --------------------------------------------------------------------------- statements around statements


def test_insert_before_and_after_in_a_function_keeps_comments_and_blank_lines():
    src = dedent("""\
        def train(model):
            x = 1

            # the step
            model.step()
            return x
    """)
    module = cst.parse_module(src)
    e = Edits()
    step = _find(module, "model.step()")
    e.add_before(step, [statement("a = 0\n")])
    e.add_after(step, [statement("b = 2\n"), statement("c = 3\n")])
    assert _apply(module, e) == dedent("""\
        def train(model):
            x = 1
            a = 0

            # the step
            model.step()
            b = 2
            c = 3
            return x
    """)


def test_wrap_moves_the_comment_above_the_with_and_keeps_later_insertions_after_it():
    src = dedent("""\
        for x, y in batches:
            # forward
            out = model(x)
            loss = f(out, y)
            loss.backward()
    """)
    module = cst.parse_module(src)
    e = Edits()
    first, second = _find(module, "out = model(x)"), _find(module, "loss = f(out, y)")
    item = cst.WithItem(item=cst.parse_expression("torch.autocast('cuda')"))
    e.wrap([first, second], with_statement([item]), [statement("out = out.float()\n")])
    e.add_after(first, [statement("seen = True\n")])
    assert _apply(module, e) == dedent("""\
        for x, y in batches:
            # forward
            with torch.autocast('cuda'):
                out = model(x)
                loss = f(out, y)
            out = out.float()
            seen = True
            loss.backward()
    """)


def test_guards_with_one_test_share_an_if_unless_an_insertion_separates_them():
    src = dedent("""\
        print("a")
        print("b")
        print("c")
        x = 1
    """)
    module = cst.parse_module(src)
    e = Edits()
    a, b, c = (_find(module, f'print("{k}")') for k in "abc")
    for s in (a, b, c):
        e.guard(s, "rank == 0")
    e.add_before(c, [statement("dist.barrier()\n")])
    assert _apply(module, e) == dedent("""\
        if rank == 0:
            print("a")
            print("b")
        dist.barrier()
        if rank == 0:
            print("c")
        x = 1
    """)


def test_replacements_see_the_rewritten_children():
    src = "model = DataParallel(net.cuda())\ntorch.save(model.state_dict(), 'x.pt')\n"
    module = cst.parse_module(src)
    e = Edits()
    wrap = _find(module, "model = DataParallel(net.cuda())")
    e.replace_statement(wrap, lambda upd: [statement("model = net.cuda()\n"), statement("model = DDP(model)\n")])
    save = _find(module, "torch.save(model.state_dict(), 'x.pt')")
    call = save.body[0].value.args[0].value  # model.state_dict()
    e.replace_node(call.func, lambda upd: upd.with_changes(value=cst.Attribute(upd.value, cst.Name("module"))))
    e.replace_node(call.func.value, cst.Name("ddp_model"))  # applied first: the callable above sees it
    assert _apply(module, e) == (
        "model = net.cuda()\nmodel = DDP(model)\ntorch.save(ddp_model.module.state_dict(), 'x.pt')\n"
    )
    assert [in_list for _, in_list in e.touched] == [True, False, False]


def test_append_to_a_function_goes_before_its_final_return_and_to_a_module_at_its_end():
    src = dedent("""\
        def main():
            run()
            return 0


        main()
    """)
    module = cst.parse_module(src)
    e = Edits()
    e.append_to_body(module.body[0], [statement("dist.destroy_process_group()\n")])
    e.append_to_body(module, [statement("print('done')\n")])
    assert _apply(module, e) == dedent("""\
        def main():
            run()
            dist.destroy_process_group()
            return 0


        main()
        print('done')
    """)


def test_no_edits_leave_the_source_byte_identical():
    src = "if x:  # keep\n    y = 1\r\nz = 2\n"
    module = cst.parse_module(src)
    assert _apply(module, Edits()) == src


def test_a_refusal_carries_its_node_and_the_reason_the_user_reads():
    node = cst.Name("model")
    with pytest.raises(Refusal) as info:
        raise Refusal(node, "`model` is built in another function")
    assert info.value.node is node
    assert info.value.reason == str(info.value) == "`model` is built in another function"


# --------------------------------------------------------------------------- one implementation


def _families_sources(families: tuple[str, ...]):
    for family in families:
        folder = os.path.join(CODEMODS, family)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield path, ast.parse(open(path, encoding="utf-8").read(), path)


def test_amp_ddp_pad_and_sync_define_no_edits_refusal_or_fresh_name_of_their_own():
    own = []
    for path, tree in _families_sources(("amp", "ddp", "pad", "sync")):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in ("Edits", "Refusal", "Refused", "Rewrite", "_Rewrite"):
                own.append(f"{os.path.relpath(path, ROOT)}: class {node.name}")
            if isinstance(node, ast.FunctionDef) and node.name in (
                "fresh",
                "_fresh",
                "stmt",
                "_stmt",
                "body_list",
                "_body_list",
            ):
                own.append(f"{os.path.relpath(path, ROOT)}: def {node.name}")
    assert not own


def _literal_block(node: ast.expr | None) -> bool:
    """A string literal, ``None``, or ``dedent()`` of a literal: an example that reads alone."""
    if node is None or (isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str))):
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dedent"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def test_amp_ddp_and_factory_examples_are_written_whole_in_their_rule():
    sources = list(_families_sources(("amp", "ddp")))
    path = os.path.join(CODEMODS, "device", "factory_then_move.py")
    sources.append((path, ast.parse(open(path, encoding="utf-8").read(), path)))
    spliced = []
    for path, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "examples" for t in node.targets
            ):
                spliced.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: examples set outside the class")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Invalid", "Valid"):
                texts = node.args[:1] + [k.value for k in node.keywords if k.arg in ("src", "after")]
                spliced += [
                    f"{os.path.relpath(path, ROOT)}:{t.lineno}: {ast.unparse(t)[:40]}"
                    for t in texts
                    if not _literal_block(t)
                ]
    assert not spliced
    assert not os.path.exists(os.path.join(CODEMODS, "ddp", "example_programs.py"))
