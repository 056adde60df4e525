"""Session set-up and the fixtures shared by test modules in more than one folder.

The helpers themselves live in the package `tests.support` (`from tests.support.configs import ...`;
`pythonpath = ["."]` in pyproject.toml makes the repository's root importable)."""

import signal

import matplotlib
import pytest
import torch

from tests.support.fakedata import write_cifar10
from tests.support.fakeruns import write_outputs

matplotlib.use("Agg")  # figures are drawn and saved, never shown


def _terminated(signum, frame):
    """SIGTERM (a CI time-out, `kill`) ends the session like Ctrl-C: pytest then runs the fixtures'
    tear-downs, so the local SLURM cluster's daemons are stopped too."""
    raise KeyboardInterrupt(f"terminated by signal {signum}")


signal.signal(signal.SIGTERM, _terminated)

#: The longest test files (minutes on the 2-core machine), started first, longest first: with
#: `--dist loadfile --no-loadscope-reorder` (the Makefile's) pytest-xdist hands out whole files in
#: collection order, so a long file collected last would run alone at the end while the other worker
#: idles. (Without `--no-loadscope-reorder` xdist sorts the files by their number of tests instead,
#: and the SLURM file, six long tests, started near the end.)
LONGEST_FIRST = (
    "tests/runtime/test_cluster.py",
    "tests/tools/test_dashboard.py",
    "tests/runtime/test_cli.py",
    "tests/evaluation/test_pipeline.py",
    "tests/tools/test_fair_protocol.py",
    "tests/tools/test_compare.py",
    "tests/tools/test_compare_parallel.py",
    "tests/methods/test_base.py",
    "tests/faults/test_folders.py",
    "tests/runtime/test_errors.py",
    "tests/faults/test_settings.py",
    "tests/faults/test_signals.py",
    "tests/runtime/test_group.py",
    "tests/methods/test_csgmcmc.py",
    "tests/docs/test_extending.py",
    "tests/tools/test_extension_package.py",
    "tests/test_wheel.py",
    "tests/tools/bench/test_gpu.py",
    "tests/methods/test_regional_compile.py",
    "tests/tools/test_refine.py",
    "tests/nets/test_classifier.py",
)


def pytest_collection_modifyitems(config, items):
    """`LONGEST_FIRST`'s files first, in that order; every other file after them in its usual place
    (a stable sort: each file's tests keep their order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))


@pytest.fixture(autouse=True)
def _distribution_argument_checks():
    """Each test starts with torch.distributions' default argument checks: torch.compile turns
    them off for the whole process (torch._dynamo patches the default on its first use)."""
    torch.distributions.Distribution.set_default_validate_args(__debug__)
    yield


@pytest.fixture(scope="session")
def cifar10_files(tmp_path_factory):
    """`cifar10_files(n_train, n_test, seed)`: the root of fake CIFAR-10 files (`write_cifar10`)
    of that size, written once a session; a module's `cifar_root` fixture names its size."""
    written = {}

    def root(n_train: int, n_test: int, seed: int = 0):
        if (n_train, n_test, seed) not in written:
            written[n_train, n_test, seed] = write_cifar10(
                tmp_path_factory.mktemp("cifar"), n_train=n_train, n_test=n_test, seed=seed
            )
        return written[n_train, n_test, seed]

    return root


@pytest.fixture
def outputs(tmp_path):
    """A hand-made outputs folder for the report (`tests.support.fakeruns.write_outputs`): one Hydra
    sweep with one failed and one missing job, plus an fbn run without .hydra."""
    return write_outputs(tmp_path)
