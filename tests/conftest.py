import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import signal


def _terminated(signum, frame):
    """SIGTERM (a CI time-out, `kill`) ends the session like Ctrl-C: pytest then runs the fixtures'
    tear-downs, so the local SLURM cluster's daemons are stopped too."""
    raise KeyboardInterrupt(f"terminated by signal {signum}")


signal.signal(signal.SIGTERM, _terminated)
