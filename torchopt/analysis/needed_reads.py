"""Host reads a step loop cannot do without: part of the control facts (``control.py``).

A host read in a step is a synchronisation the program could often avoid (log every N steps, keep
a running sum on the device). Some reads are what the loop exists for, and no rewrite of the
program removes them. :func:`needed_read` says why a read is one of those, or None:

* **A closed loop through host code.** The value read goes (directly, or through the name it is
  assigned to) to a call that is neither torch's nor a function of this file (an environment's
  ``step``, a simulator, a game), and what that call returns is read earlier in the same loop
  body, so on the next iteration: the next step's input comes from host code that needs this
  step's value (``next_obs, reward, ... = env.step(action.cpu().numpy())``, then
  ``agent(next_obs)`` at the top of the loop). The wait is the program's own data dependence.
* **The output of an inference loop.** In a loop that runs no backward pass, the value read goes
  to a call that writes a file (``scipy.io.wavfile.write``, ``soundfile.write``, ``cv2.imwrite``,
  ``numpy.save``, ...) at a path: each iteration's result is written as it is made, which is what
  the program is for (collecting the outputs on the device first would hold every output in device
  memory, and outputs of different sizes cannot be stacked).

Everything else is not established (None), and the rules keep their findings.
"""

from __future__ import annotations

import libcst as cst

from torchopt.analysis.file_targets import file_target
from torchopt.analysis.names import callee, dotted, qualified_names
from torchopt.analysis.step_loops import hot_map
from torchopt.analysis.syntax import walk
from torchopt.rewrite.metadata import ParentProvider
from torchopt.rewrite.rule import Rule

# Calls that write their data argument to the file named by their first argument.
_FILE_WRITERS = {
    "scipy.io.wavfile.write",
    "soundfile.write",
    "cv2.imwrite",
    "imageio.imwrite",
    "imageio.v2.imwrite",
    "imageio.v3.imwrite",
    "numpy.save",
    "numpy.savetxt",
    "numpy.savez",
    "numpy.savez_compressed",
    "matplotlib.pyplot.imsave",
    "skimage.io.imsave",
}


def needed_read(rule: Rule, read: cst.CSTNode) -> str | None:
    """Why the host read ``read`` (a call such as ``t.numpy()``) is needed by its step loop, or None."""
    hm = hot_map(rule)
    where = hm.where(read)
    if where is None or where.via is not None:
        return None
    loop = where.loop.node
    for consumer in _consumers(rule, read, loop):
        name = dotted(consumer.func) or "a call"
        q = callee(rule, consumer)
        if (q is not None and q.startswith("torch")) or hm.resolve(consumer, None):
            continue  # torch, or a function of this file: what it does with the value can change
        written = qualified_names(rule, consumer.func) & _FILE_WRITERS
        if written and where.loop.kind != "training" and consumer.args:
            if file_target(rule, consumer.args[0].value) == "path":
                return f"it is written to a file by `{name}()`: each iteration's output"
        if _feeds_next_iteration(consumer, loop):
            return f"`{name}()` needs it, and what it returns is the next iteration's input"
    return None


def _consumers(rule: Rule, read: cst.CSTNode, loop: cst.For | cst.While | cst.FunctionDef) -> list[cst.Call]:
    """The calls that take the value read: the call it is an argument of, or the calls later in the
    loop's body that take the name it is assigned to."""
    cur: cst.CSTNode = read
    parent = rule.get_metadata(ParentProvider, cur, None)
    while parent is not None and not isinstance(parent, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
        if isinstance(parent, cst.Arg):
            call = rule.get_metadata(ParentProvider, parent, None)
            return [call] if isinstance(call, cst.Call) else []
        cur, parent = parent, rule.get_metadata(ParentProvider, parent, None)
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
        return []
    target = parent.targets[0].target
    if not isinstance(target, cst.Name):
        return []
    out: list[cst.Call] = []
    seen = False
    for node in walk(loop.body):
        if node is parent:
            seen = True
        elif seen and isinstance(node, cst.Call):
            if any(isinstance(a.value, cst.Name) and a.value.value == target.value for a in node.args):
                out.append(node)
    return out


def _feeds_next_iteration(consumer: cst.Call, loop: cst.For | cst.While | cst.FunctionDef) -> bool:
    """What ``consumer`` returns (and what the loop computes from it later in its body) is read
    before ``consumer`` in the loop's body: it reaches the next iteration."""
    order = {id(n): i for i, n in enumerate(walk(loop.body))}
    at = order.get(id(consumer))
    if at is None:
        return False
    names: set[str] = set()
    for node in walk(loop.body):
        if isinstance(node, cst.Assign) and (
            node.value is consumer or (names and _reads(node.value, names) and order[id(node)] > at)
        ):
            names.update(_targets(node))
    if not names:
        return False
    assigned = {id(t) for node in walk(loop.body) if isinstance(node, cst.Assign) for t in _target_nodes(node)}
    return any(
        isinstance(n, cst.Name) and n.value in names and order[id(n)] < at and id(n) not in assigned
        for n in walk(loop.body)
    )


def _reads(expr: cst.BaseExpression, names: set[str]) -> bool:
    return any(isinstance(n, cst.Name) and n.value in names for n in walk(expr))


def _target_nodes(node: cst.Assign) -> list[cst.Name]:
    return [n for t in node.targets for n in walk(t.target) if isinstance(n, cst.Name)]


def _targets(node: cst.Assign) -> set[str]:
    out = set()
    for t in node.targets:
        if isinstance(t.target, cst.Name):
            out.add(t.target.value)
        elif isinstance(t.target, (cst.Tuple, cst.List)):
            out.update(e.value.value for e in t.target.elements if isinstance(e.value, cst.Name))
    return out
