"""Host memory that a sharded run frees goes back to the system (glibc's malloc on Linux).

Under FSDP every step allocates and frees the whole model in pieces: each block's gathered parameters and its
whole gradients, then its reduce-scatter buffer, and the activations. glibc serves pieces under its mmap
threshold from its heap, and that threshold rises with each large piece freed (up to 32 MiB): from the first
step on, the gathered blocks live on the heap, whose holes between the gradient shards made meanwhile are
neither returned nor reused well: a rank keeps several times its shard resident, all through the saves and
evaluations. A fixed threshold maps each larger piece on its own, returned to the system when freed; at 64 KiB
the activations of short sequences go back too. It costs page faults for those pieces, too few to show in step
times (docs/dev/design-notes.md). DDP runs keep glibc's default.
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
