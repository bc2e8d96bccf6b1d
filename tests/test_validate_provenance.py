"""Which globals the validator leaves out as clock, process or OS-random values.

`random` and `numpy.random` are seeded by the harness before the program starts, so what a script
draws from them (or from a generator it seeds itself) is the same in both runs and is compared;
only draws seeded from the operating system are left out.
"""

from __future__ import annotations

from torchopt.validate.provenance import uncomputed_globals


def test_seeded_random_data_and_what_the_model_computes_from_it_are_compared():
    src = (
        "import random\nimport numpy as np\nimport torch\n"
        "rng = np.random.default_rng(0)\n"
        "batches = [rng.standard_normal((8, 6)) for _ in range(4)]\n"
        "order = random.sample(range(4), 4)\n"
        "noise = np.random.rand(3)\n"
        "total = 0.0\n"
        "for i in order:\n    total += float(torch.from_numpy(batches[i]).sum())\n"
    )
    assert uncomputed_globals(src) == set()


def test_draws_seeded_from_the_operating_system_are_left_out():
    src = (
        "import random\nimport numpy as np\nfrom random import SystemRandom\n"
        "random.seed()\n"
        "jitter = random.random()\n"
        "gen = np.random.default_rng()\n"
        "picked = gen.integers(10)\n"
        "token = SystemRandom().random()\n"
        "kept = np.random.default_rng(7).normal()\n"
    )
    assert uncomputed_globals(src) == {"jitter", "gen", "picked", "token"}
