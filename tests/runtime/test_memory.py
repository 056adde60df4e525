"""Freed host memory is reused without page faults once `keep_freed_memory()` is in effect.

Each case runs in a fresh interpreter (malloc's settings are per process): it allocates and
frees the same five tensors (276 MB) again and again, as a training step does with its
activations, and counts the minor page faults of each repetition. With glibc's defaults every
repetition maps the blocks afresh and faults on nearly all of their ~67,000 pages; with the
setting the heap grows over the first repetitions, then the blocks come back from it, already
mapped.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.scripts import run_python

PROBE = """
import json, resource, torch
from dbsn.runtime.memory import keep_freed_memory
applied = keep_freed_memory()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [torch.ones(n) for n in SIZES]  # written in full
    del live
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""

SIZES = (25_000_000, 5_000_000, 12_000_000, 2_000_000, 25_000_000)  # float32 elements
PAGES = 4 * sum(SIZES) // 4096


def _probe(keep: str) -> dict:
    out = run_python("-c", f"SIZES = {SIZES}" + PROBE, env={"DBSN_KEEP_FREED_MEMORY": keep})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_freed_blocks_are_reused_without_page_faults():
    kept = _probe("1")
    assert kept["applied"]
    # the heap grows over the first repetitions (an aligned request does not always fit the
    # block it freed; measured: for 2 to 6 of them), then the blocks are reused: no new page
    assert max(kept["faults"][-4:]) < 0.02 * PAGES, kept["faults"]
    default = _probe("0")
    assert not default["applied"]
    assert min(default["faults"][1:]) > 0.8 * PAGES  # glibc's default: the pages fault again, every time


RELEASE_PROBE = """
import json, torch
from dbsn.runtime.memory import keep_freed_memory, release_freed_memory

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

keep_freed_memory()
start = resident_mb()
live = [torch.ones(n) for n in SIZES]
del live
kept = resident_mb()
released = release_freed_memory()
print(json.dumps({"start": start, "kept": kept, "after": resident_mb(), "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_released_memory_leaves_the_process_and_the_setting_stays():
    """With freed memory kept, the 276 MB of freed tensors stay resident; `release_freed_memory`
    gives them back (what is in use, the interpreter and torch, stays)."""
    out = json.loads(run_python("-c", f"SIZES = {SIZES}" + RELEASE_PROBE).stdout.strip().splitlines()[-1])
    size_mb = 4 * sum(SIZES) / 2**20
    assert out["kept"] - out["start"] > 0.9 * size_mb, out  # kept: the heap holds them
    assert out["released"] and out["after"] - out["start"] < 0.1 * size_mb, out


def test_calling_it_again_changes_nothing():
    from dbsn.runtime.memory import keep_freed_memory

    assert keep_freed_memory() == keep_freed_memory()
