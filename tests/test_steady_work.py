"""Whether a CPU program repeats tensor work (``analysis/run_once.steady_work``, asked by TOP951) when a loop
calls a function of the file: the function's own body is read (it used to be read as a list of statements,
and the check of the file failed with an internal error)."""

from __future__ import annotations

from textwrap import dedent

from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source

PROGRAM = dedent("""\
    import torch


    def epsilon(start, end, t):
        slope = (end - start) / 100
        return max(slope * t + start, end)


    if __name__ == "__main__":
        for t in range(3):
            print(epsilon(1.0, 0.05, t))
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for t in range(1000):
            loss = model(torch.randn(8, 4)).sum() * epsilon(1.0, 0.05, t)
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


def test_a_loop_that_calls_a_function_of_the_file_is_read_through_it() -> None:
    codes = [d.code for d in check_source(PROGRAM, Settings(), "sim.py", codes=["TOP951"]).diagnostics]
    assert codes == ["TOP951"]  # a CPU program that trains: the launch advice, and no failure
