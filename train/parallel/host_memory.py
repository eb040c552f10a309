"""Host memory that a sharded run frees goes back to the system (glibc's malloc on Linux).

Under FSDP every step allocates and frees the whole model in pieces: each block's gathered parameters and its
whole gradients, then its reduce-scatter buffer, and the activations. glibc serves pieces under its mmap
threshold from its heap, and that threshold rises with each large piece freed (up to 32 MiB): from the first
step on, the gathered blocks live on the heap, whose holes between the gradient shards made meanwhile are
neither returned nor reused well. On CPU ranks that kept 1.6x the model's bytes resident on each of 4 ranks,
all through the saves and evaluations, where the rank holds 0.25x (bench/fsdp_run_memory.py). A fixed
threshold maps each larger piece on its own, returned to the system when freed. At 1 MiB the activations of
short sequences (256 KiB a tensor at 64 tokens of width 1024) still stayed on the heap, 0.07x of the model
there; at 64 KiB they go back too. It costs page faults for those pieces: on that shared 2-core machine, step
times with and without it were within its noise. DDP runs keep glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 64 << 10  # bytes: larger allocations are mapped on their own, and unmapped when freed


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD for this process (no more rising); whether it was set. Not where
    the user set MALLOC_MMAP_THRESHOLD_ (glibc's own variable, which wins), nor off glibc (macOS, musl)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
