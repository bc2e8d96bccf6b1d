"""The program-precision and workload facts (torchopt/analysis/precision.py, workload.py) and the
rules that ask them: a program trained in half precision by hand, an opt-in `.half()`, a small
policy trained between environment steps."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst
from libcst.metadata import MetadataWrapper

from torchopt.analysis.precision import precision_of
from torchopt.analysis.workload import workload_of
from torchopt.rewrite.config import Settings
from torchopt.rewrite.engine import check_source
from torchopt.rewrite.rule import Rule, RuleContext


class _Probe(Rule):
    code, name, family, message = "TOP000", "probe", "probe", "probe"


def _rule(src: str) -> _Probe:
    wrapper = MetadataWrapper(cst.parse_module(dedent(src)), unsafe_skip_copy=True)
    rule = _Probe(RuleContext(wrapper.module, {}, ("device", "dev", "*_device")))
    rule.resolving = rule.resolve(wrapper)  # kept alive: closing it drops the metadata
    rule.resolving.__enter__()
    return rule


def _found(src: str, select: str) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in check_source(dedent(src), Settings(select=(select,))).diagnostics]


# A network cast to half by hand, its norm layers put back to float32 (a speed-run's own scheme).
HALF_BY_HAND = """\
import torch
import torch.nn as nn


def make_net():
    net = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    net = net.half().cuda()
    net = net.to(memory_format=torch.channels_last)
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.float()
    return net


def main(loader):
    model = make_net()
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in loader:
        outputs = model(inputs)
        loss = loss_fn(outputs, labels).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""

# `.half()` only under a switch that is off by default.
OPT_IN_HALF = """\
import argparse
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--half", action="store_true")


def main():
    args = parser.parse_args()
    model = nn.DataParallel(nn.Linear(64, 64)).cuda()
    criterion = nn.CrossEntropyLoss().cuda()
    if args.half:
        model.half()
        criterion.half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in [(torch.randn(8, 64).cuda(), torch.zeros(8, dtype=torch.long).cuda())]:
        output = model(x)
        loss = criterion(output, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
"""

# A DQN: a 120-84 MLP updated between environment steps.
DQN = """\
import gymnasium as gym
import torch
import torch.nn as nn


class QNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(env.observation_space.shape[0], 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, env.action_space.n),
        )

    def forward(self, x):
        return self.network(x)


if __name__ == "__main__":
    device = torch.device("cuda")
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    q_network = QNetwork(envs).to(device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=1e-4)
    obs, _ = envs.reset()
    for global_step in range(10000):
        actions = q_network(torch.Tensor(obs).to(device)).argmax(dim=1).cpu().numpy()
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        obs = next_obs
        if global_step > 100:
            for _ in range(2):
                old_val = q_network(torch.Tensor(obs).to(device)).max(dim=1)[0]
                loss = (torch.Tensor(rewards).to(device) - old_val).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
"""


def test_half_by_hand_is_half_and_restored():
    p = precision_of(_rule(HALF_BY_HAND))
    assert p.kind == "half" and p.restored and [c.model for c in p.casts] == ["net"]


def test_opt_in_half_is_no_half_program():
    p = precision_of(_rule(OPT_IN_HALF))
    assert p.kind == "float32"
    assert [c.model for c in p.opt_in()] == ["model"]


def test_plain_program_is_float32_and_autocast_mixed():
    assert precision_of(_rule(DQN)).kind == "float32"
    src = OPT_IN_HALF.replace(
        "        output = model(x)", "        with torch.autocast('cuda'):\n            output = model(x)"
    )
    assert precision_of(_rule(src)).kind == "mixed"


def test_half_by_hand_gets_no_amp_advice():
    assert _found(HALF_BY_HAND, "TOP202") == []
    assert _found(HALF_BY_HAND, "TOP204") == []


def test_half_without_restoring_is_still_reported():
    src = HALF_BY_HAND.replace(
        "    for mod in net.modules():\n        if isinstance(mod, nn.BatchNorm2d):\n            mod.float()\n", ""
    )
    assert [c for c, _ in _found(src, "TOP204")] == ["TOP204"]


def test_opt_in_half_refusal_names_the_switch():
    found = _found(OPT_IN_HALF, "TOP202")
    assert found and all("args.half" in m and "opt-in" in m for _, m in found), found


# The same, the step in a function the caller hands the model and optimizer to.
OPT_IN_HALF_REMOTE = """\
import argparse
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--half", action="store_true")


def main():
    args = parser.parse_args()
    model = nn.Linear(64, 64).cuda()
    criterion = nn.CrossEntropyLoss().cuda()
    if args.half:
        model.half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        train(model, criterion, optimizer)


def train(model, criterion, optimizer):
    for x, y in [(torch.randn(8, 64).cuda(), torch.zeros(8, dtype=torch.long).cuda())]:
        output = model(x)
        loss = criterion(output, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
"""


def test_opt_in_half_refusal_names_the_switch_in_a_called_step():
    found = _found(OPT_IN_HALF_REMOTE, "TOP202")
    assert found and all("args.half" in m and "opt-in" in m for _, m in found), found


def test_environment_bound_small_policy():
    w = workload_of(_rule(DQN))
    assert w.small_mlp and w.environment_bound and max(w.widths) == 120


def test_environment_bound_policy_gets_no_padding_or_amp_advice():
    assert _found(DQN, "TOP302") == []
    assert _found(DQN, "TOP202") == []


def test_wide_or_env_free_models_keep_their_advice():
    wide = DQN.replace("120", "1200")
    assert not workload_of(_rule(wide)).environment_bound
    no_env = DQN.replace("envs.step(actions)", "(obs, 0.0, None, None, None)")
    assert not workload_of(_rule(no_env)).environment_bound
    assert [c for c, _ in _found(no_env, "TOP302")] == ["TOP302", "TOP302"]


# The optimizer is rebound under a switch in `main`, then handed to `train` as a parameter.
REBOUND_OPTIMIZER = """\
import argparse
import torch
import torch.nn as nn
from lars import LARC

parser = argparse.ArgumentParser()
parser.add_argument("--lars", action="store_true")


def main():
    args = parser.parse_args()
    model = nn.Linear(64, 10).cuda()
    criterion = nn.CrossEntropyLoss().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.lars:
        optimizer = LARC(optimizer=optimizer)
    for epoch in range(3):
        train(model, criterion, optimizer)


def train(model, criterion, optimizer):
    for x, y in [(torch.randn(8, 64).cuda(), torch.zeros(8, dtype=torch.long).cuda())]:
        output = model(x)
        loss = criterion(output, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
"""


def test_optimizer_handed_as_parameter_is_said_so():
    found = _found(REBOUND_OPTIMIZER, "TOP202")
    assert found, found
    for _, m in found:
        assert "handed to the step's function as a parameter" in m and "neither a parameter" not in m, m


# DataParallel trained over loaders another module builds, through `tqdm(loaders[0])`.
IMPORTED_LOADERS = """\
import torch
import torch.nn as nn
from tqdm import tqdm

import utils
import train_fns


def run(config):
    G = nn.Linear(128, 128).cuda()
    GD = nn.DataParallel(G)
    optim = torch.optim.Adam(G.parameters())
    loaders = utils.get_data_loaders(**config)
    train = train_fns.training_function(GD, optim)
    for epoch in range(config["epochs"]):
        pbar = tqdm(loaders[0])
        for i, (x, y) in enumerate(pbar):
            x, y = x.cuda(), y.cuda()
            metrics = train(x, y)


if __name__ == "__main__":
    run({"epochs": 2})
"""


def test_data_parallel_refusal_names_the_loop_it_cannot_read():
    [(code, message)] = _found(IMPORTED_LOADERS, "TOP401")
    assert "the loop over `enumerate(pbar)` (line 17)" in message
    assert "no training loop over a `DataLoader` was found" not in message


# An inference loop in a function, its model built under the main guard below it; no optimizer.
INFERENCE_BELOW = """\
import torch
import torch.nn as nn


@torch.no_grad()
def extract(loader, net, device):
    feats = []
    for img in loader:
        img = img.to(device)
        out = net(img).flatten(1)
        feats.append(out.cpu())
    return feats


if __name__ == "__main__":
    device = torch.device("cuda")
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval().to(device)
    extract([torch.randn(2, 3, 8, 8)], net, device)
"""


def test_inference_refusal_names_what_the_set_up_must_follow():
    found = [m for c, m in _found(INFERENCE_BELOW, "TOP205")]
    assert found and all("optimizer" not in m and "must follow `net = nn.Sequential(" in m for m in found), found


# PPO: each iteration runs a rollout loop of environment steps, then the update epochs.
PPO = """\
import gymnasium as gym
import torch
import torch.nn as nn

if __name__ == "__main__":
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    agent = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).cuda()
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4)
    obs, _ = envs.reset()
    for iteration in range(100):
        for step in range(128):
            logits = agent(torch.Tensor(obs).cuda())
            obs, reward, term, trunc, info = envs.step(logits.argmax(1).cpu().numpy())
        for epoch in range(4):
            loss = agent(torch.Tensor(obs).cuda()).logsumexp(1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
"""


def test_rollout_loop_makes_the_update_environment_bound():
    assert workload_of(_rule(PPO)).environment_bound
    assert _found(PPO, "TOP202") == []
