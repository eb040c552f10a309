"""Process start-up: torch imported without the garbage collector.

Importing torch (with torch.distributed.checkpoint, the trainer's) creates about half a million objects, which
live as long as the process. With the collector on, it walks them again and again while they are being
created, for nothing: a good part of the import's CPU time. Every process that imports torch on its way to work
(a rank, torchrun's process, the loader workers' fork server) does so inside `frozen_imports()`: no collection
while it runs, then what it imported is frozen (gc.freeze: never walked again, as the trainer freezes what it
built) and collection is turned back on. The few objects that the imports leave unreachable are frozen with the
rest: a little memory, once per process.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
