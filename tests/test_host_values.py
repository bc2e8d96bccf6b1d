"""Value facts that make a host read no synchronisation: a program that never selects an accelerator
(every tensor on the host), checked on small programs of one or two files."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from typer.testing import CliRunner

import torchopt.cli

STEP = """\
    import torch
    {imports}

    model = torch.nn.Linear(4, 1){move}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(10):
        x = torch.randn(8, 4){move}
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(sum(losses))


    if __name__ == "__main__":
        pass
"""


def _write(root: Path, files: dict[str, str]) -> None:
    (root / "pyproject.toml").write_text("", encoding="utf-8")
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dedent(text), encoding="utf-8")


def _codes(root: Path, rel: str, select: str = "TOP601") -> list[str]:
    r = CliRunner().invoke(
        torchopt.cli.app, ["check", str(root / rel), "--no-cache", "--select", select], catch_exceptions=False
    )
    return [line.split()[1] for line in r.stdout.splitlines() if ": TOP" in line]


def _step(imports: str = "", move: str = "") -> str:
    return dedent(STEP).format(imports=imports, move=move)


def test_a_program_that_never_selects_an_accelerator_reads_host_tensors(tmp_path):
    _write(tmp_path, {"train.py": _step()})
    assert _codes(tmp_path, "train.py") == []


def test_a_program_that_moves_its_tensors_to_a_gpu_syncs(tmp_path):
    _write(tmp_path, {"train.py": _step(move=".cuda()")})
    assert _codes(tmp_path, "train.py") == ["TOP601"]


def test_a_device_chosen_elsewhere_may_be_a_gpu(tmp_path):
    imports = "import os\ndevice = torch.device(os.environ['DEV'])"
    _write(tmp_path, {"train.py": _step(imports=imports, move=".to(device)")})
    assert _codes(tmp_path, "train.py") == ["TOP601"]


def test_a_device_option_may_be_given_a_gpu_whatever_its_default(tmp_path):
    imports = (
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--device', default='cpu')\n"
        "device = p.parse_args().device"
    )
    _write(tmp_path, {"train.py": _step(imports=imports, move=".to(device)")})
    assert _codes(tmp_path, "train.py") == ["TOP601"]


def test_an_imported_project_module_that_picks_a_device_keeps_the_finding(tmp_path):
    helper = "import torch\n\ndef place(m):\n    return m.cuda()\n"
    _write(tmp_path, {"train.py": _step(imports="from helpers import place"), "helpers.py": helper})
    assert _codes(tmp_path, "train.py") == ["TOP601"]
    _write(tmp_path, {"helpers.py": "import torch\n\ndef place(m):\n    return m\n"})
    assert _codes(tmp_path, "train.py") == []


def test_a_checkpoint_loaded_without_map_location_may_be_on_a_gpu(tmp_path):
    imports = "state = torch.load('ckpt.pt')"
    _write(tmp_path, {"train.py": _step(imports=imports)})
    assert _codes(tmp_path, "train.py") == ["TOP601"]


def test_a_module_without_a_main_guard_may_be_handed_device_tensors(tmp_path):
    src = _step().split("\n\n\nif __name__")[0] + "\n"
    assert "__main__" not in src
    _write(tmp_path, {"train.py": src})
    assert _codes(tmp_path, "train.py") == ["TOP601"]


PROGRESS = """\
    import torch
    from tqdm import tqdm


    def train(num_batches=100, validate_every=10):
        model = torch.nn.Linear(4, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in tqdm({iterable}):
            loss = model(torch.randn(8, 4).cuda()).pow(2).mean()
            loss.backward()
            opt.step()
            if i % validate_every == 0:
                model.eval()
"""


def test_a_progress_bar_over_range_gives_python_ints(tmp_path):
    _write(tmp_path, {"train.py": PROGRESS.format(iterable="range(num_batches)")})
    assert _codes(tmp_path, "train.py", "TOP605") == []


def test_a_progress_bar_over_a_device_tensor_gives_tensors(tmp_path):
    _write(tmp_path, {"train.py": PROGRESS.format(iterable="torch.arange(num_batches).cuda()")})
    assert _codes(tmp_path, "train.py", "TOP605") == ["TOP605"]


END_OF_DATA = """\
    import torch
    import torch.distributed as dist


    def evaluate(model, batches, device, rank):
        signal = torch.zeros(1, device=device, dtype=torch.long)
        it = iter(batches)
        while {loop}:
            if rank == 0:
                batch = next(it, None)
                signal.fill_(0 if batch is None else 1)
            dist.broadcast(signal, src=0)
            if signal.item() == 0:
                break
            model(batch.to(device)).sum().backward()
"""


def test_a_read_that_decides_whether_a_while_true_loop_goes_on_is_needed(tmp_path):
    _write(tmp_path, {"ev.py": END_OF_DATA.format(loop="True")})
    assert _codes(tmp_path, "ev.py") == []


def test_a_read_that_only_stops_a_loop_early_is_reported(tmp_path):
    _write(tmp_path, {"ev.py": END_OF_DATA.format(loop="len(batches) > 0")})
    assert _codes(tmp_path, "ev.py") == ["TOP601"]


def test_a_stop_decision_no_collective_shares_can_be_checked_less_often(tmp_path):
    src = END_OF_DATA.format(loop="True").replace("dist.broadcast(signal, src=0)", "pass")
    _write(tmp_path, {"ev.py": src})
    assert _codes(tmp_path, "ev.py") == ["TOP601"]


NAMED_PERIOD = """\
    import torch


    def train(model, loader, opt, log_every, n_batches):
        for i, x in enumerate(loader):
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
            last = i == n_batches - 1
            log_step = {test}
            if log_step:
                print(loss.item())
"""


def test_a_name_holding_a_periodic_test_makes_its_branch_periodic(tmp_path):
    _write(tmp_path, {"t.py": NAMED_PERIOD.format(test="i % log_every == 0 or last")})
    assert _codes(tmp_path, "t.py") == []


def test_a_name_holding_another_test_leaves_its_branch_every_step(tmp_path):
    _write(tmp_path, {"t.py": NAMED_PERIOD.format(test="i > log_every or last")})
    assert _codes(tmp_path, "t.py") == ["TOP601"]


ENV_LOOP = """\
    import torch
    import gym


    def rollout(n):
        policy = torch.nn.Linear(4, 2).cuda()
        env = gym.make("CartPole-v1")
        obs = env.reset()
        for step in range(n):
            with torch.no_grad():
                action = policy(torch.as_tensor(obs).cuda())
            {line}


    if __name__ == "__main__":
        rollout(10)
"""


def test_an_action_sent_to_an_environment_whose_answer_is_the_next_input_is_needed(tmp_path):
    _write(tmp_path, {"rl.py": ENV_LOOP.format(line="obs, reward, done, info = env.step(action.cpu().numpy())")})
    assert _codes(tmp_path, "rl.py") == []


def test_a_host_copy_whose_result_the_loop_never_reads_again_is_reported(tmp_path):
    _write(tmp_path, {"rl.py": ENV_LOOP.format(line="shown = env.render(action.cpu().numpy())")})
    assert _codes(tmp_path, "rl.py") == ["TOP601"]


WRITE_LOOP = """\
    import torch
    from scipy.io.wavfile import write


    def synthesize(model, mels, opt):
        for i, mel in enumerate(mels):
            audio = model(mel.cuda()).squeeze()
            {extra}
            audio = audio.cpu().numpy()
            write(f"out_{{i}}.wav", 22050, audio)
"""


def test_each_output_of_an_inference_loop_written_to_its_file_is_needed(tmp_path):
    _write(tmp_path, {"synth.py": WRITE_LOOP.format(extra="pass")})
    assert _codes(tmp_path, "synth.py") == []


def test_a_file_write_in_a_training_step_is_a_log(tmp_path):
    _write(tmp_path, {"synth.py": WRITE_LOOP.format(extra="audio.sum().backward(); opt.step()")})
    assert _codes(tmp_path, "synth.py") == ["TOP601"]


FIRST_FEW = """\
    import torch


    def evaluate(model, loader, figures):
        for j, x in enumerate(loader):
            y = model(x.cuda())
            if {test}:
                figures.append(y.cpu().numpy())
"""


def test_a_loop_counter_below_a_small_literal_runs_a_few_times(tmp_path):
    _write(tmp_path, {"ev.py": FIRST_FEW.format(test="j <= 4")})
    assert _codes(tmp_path, "ev.py") == []


def test_a_counter_above_a_literal_or_another_number_runs_every_step(tmp_path):
    _write(tmp_path, {"ev.py": FIRST_FEW.format(test="j >= 4")})
    assert _codes(tmp_path, "ev.py") == ["TOP601"]
    _write(tmp_path, {"ev.py": FIRST_FEW.format(test="len(figures) <= 4")})
    assert _codes(tmp_path, "ev.py") == ["TOP601"]


CALLED_FROM_MAIN = """\
    import argparse
    import torch
    from tqdm import tqdm


    def train(args, model, optimizer, loader):
        pbar = range(args.iters)
        if args.rank == 0:
            pbar = tqdm(pbar, initial=args.start_iter)
        for idx in pbar:
            i = idx + args.start_iter
            x = next(loader).cuda()
            loss = model(x).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i > args.stop:
                break
            log_now = i % args.log_every == 0
            if log_now:
                print(i)


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--iters", type=int, default=10)
        {bind}
        model = torch.nn.Linear(4, 1).cuda()
        train(args, model, torch.optim.SGD(model.parameters(), lr=0.1), iter([]))
"""


def test_a_parameter_takes_what_every_call_passes_the_parsed_options_give_host_values(tmp_path):
    _write(tmp_path, {"train.py": CALLED_FROM_MAIN.format(bind="args = parser.parse_args()")})
    assert _codes(tmp_path, "train.py", "TOP605") == []


def test_a_parameter_whose_caller_passes_an_unknown_value_stays_unknown(tmp_path):
    _write(tmp_path, {"train.py": CALLED_FROM_MAIN.format(bind="args = load_settings()")})
    assert _codes(tmp_path, "train.py", "TOP605") == ["TOP605", "TOP605"]


WRAPPED_COUNTER = """\
    import torch
    from utils.general import TQDM


    def train(model, opt, loader, epochs):
        nb = len(loader)
        nw = max(round(3 * nb), 100)
        for epoch in range(epochs):
            pbar = enumerate(loader)
            if epoch > 0:
                pbar = TQDM(pbar, total=nb)
            for i, (imgs, targets) in pbar:
                ni = i + nb * epoch
                if ni <= nw:
                    opt.param_groups[0]["lr"] = 0.1 * ni / nw
                loss = model(imgs.cuda()).sum()
                loss.backward()
                opt.step()
"""


def test_a_progress_bar_a_project_module_re_exports_from_a_library_gives_python_ints(tmp_path):
    _write(
        tmp_path,
        {"train.py": WRAPPED_COUNTER, "utils/__init__.py": "", "utils/general.py": "from tqdm import tqdm as TQDM\n"},
    )
    assert _codes(tmp_path, "train.py", "TOP605") == []
    # a wrapper of the project's own, whose iteration is not followed, leaves the counter unknown
    own = "class TQDM:\n    def __init__(self, it, total=None):\n        self.it = it\n"
    _write(tmp_path, {"utils/general.py": own})
    assert _codes(tmp_path, "train.py", "TOP605") == ["TOP605"]
