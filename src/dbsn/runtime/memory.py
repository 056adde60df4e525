"""Host memory: keep freed blocks for reuse instead of handing them back to the kernel.

glibc's malloc serves large requests (above a threshold that grows to at most 32 MiB) with a
fresh `mmap` and gives them back with `munmap` when freed; it also trims the top of the heap
once enough is free there. A CPU training step of this network allocates and frees the same
large activations every step (the grouped T = 4 step: blocks of up to 100 MB), so every step maps
them again and the kernel zero-fills every page on first touch: hundreds of thousands of page
faults and seconds of system time per step, varying with what ran before (docs/performance.md).

`keep_freed_memory()` tells malloc to serve every request from its heap and never to trim it:
after a few steps the heap holds every block a step needs and freed activations are reused
without a page fault. The cost is memory: the process keeps what it freed, and the heap settles a
little above the peak that mmap'd blocks would reach (an aligned request does not always fit the
block it freed). It acts on glibc only (Linux); elsewhere it does nothing.
`DBSN_KEEP_FREED_MEMORY=0` turns it off.

`release_freed_memory()` hands what the heap holds free back to the kernel at once (glibc's
`malloc_trim`: the free pages of every arena, not only the top). An evaluation calls it between
its phases (the test pass, each OOD set, the attack), so that the next does not start on top of
the heap the earlier ones kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory", "release_freed_memory"]

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Serve all allocations from malloc's heap and never trim it (see the module docstring).
    Returns whether the setting is in effect; calling it again changes nothing."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("DBSN_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    return _applied


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (glibc's `malloc_trim(0)`); the blocks in use
    stay where they are. Returns whether memory was released (False: nothing to release, or not
    glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return malloc_trim(0) == 1
