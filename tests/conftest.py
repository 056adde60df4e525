import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def _terminated(signum, frame):
    """SIGTERM (a CI time-out, `kill`) ends the session like Ctrl-C: pytest then runs the fixtures'
    tear-downs, so the local SLURM cluster's daemons are stopped too."""
    raise KeyboardInterrupt(f"terminated by signal {signum}")


signal.signal(signal.SIGTERM, _terminated)


@pytest.fixture(autouse=True)
def _distribution_argument_checks():
    """Each test starts with torch.distributions' default argument checks: torch.compile turns
    them off for the whole process (torch._dynamo patches the default on its first use)."""
    torch.distributions.Distribution.set_default_validate_args(__debug__)
    yield
