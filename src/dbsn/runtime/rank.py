"""Which rank this process is."""

from __future__ import annotations

import os

from lightning.pytorch.utilities import rank_zero_only


def is_rank_zero() -> bool:
    """Rank 0 of the job, also before Lightning has set its rank (DDP children know theirs from LOCAL_RANK)."""
    return rank_zero_only.rank == 0 and os.environ.get("LOCAL_RANK", "0") == "0"
