import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# End-to-end runs are marked `slow`: the README's quick suite (-m "not slow") leaves them out and CI
# runs them after it. They are whole programs under `torchopt validate`, torchrun on two ranks, Ray,
# process signals, and the audit of every rule without its prefilter.
SLOW_MODULES = {
    "test_validate",
    "test_validate_gate",
    "test_reliability_validate",
    "test_ddp_fixtures",
    "test_pad_validate",
    "test_pad_conv_validate",
    "test_prefilter_sound",
}
SLOW_TESTS = re.compile(
    r"validat|torchrun|gloo|two_ranks|ray_executor|bench|keep_every_value_bitwise"
    r"|stop_signal|killed_parent|workers_die"
)

# Seconds a slow test may take (the quick ones: `timeout` in pyproject.toml): whole programs run
# twice under `torchopt validate`, on a loaded CI machine.
SLOW_TIMEOUT = 900


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in SLOW_MODULES or SLOW_TESTS.search(item.originalname or item.name):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


@pytest.fixture(autouse=True, scope="session")
def _private_user_cache(tmp_path_factory):
    """Runs that cache (in this process or a subprocess) keep their results and the cache key in a
    folder of the test session, never in the home folder of whoever runs the tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))
        yield
