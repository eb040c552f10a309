"""A loader worker's arguments (the data set among them) sent to the fork server, whatever number of tensors
they hold.

multiprocessing pickles a new worker's arguments with its ForkingPickler, into which torch registers its
reductions: each CPU tensor storage is moved into shared memory and sent as a file descriptor
(torch/multiprocessing/reductions.py, reduce_storage), and the fork server takes at most MAXFDS_TO_SEND (256)
descriptors in one message (multiprocessing/forkserver.py, connect_to_new_process: "ValueError: too many fds").
A data set held as a few big tensors passes; one held as thousands of separate tensors (a list of (x, y)
pairs, of dict records) did not start a worker at all. Each shared storage also keeps a descriptor open in
the training process for good (and a mapping in each worker).

Here the arguments are pickled first with the storages set aside. Up to OWN_FDS of them go as before, shared
one descriptor each (moved into shared memory in place: no copy), so the common case of a few big tensors is
unchanged. Beyond that, the largest (of at least OWN_FROM bytes) still go so, and the rest are copied into one
shared block, sent as one descriptor, on which the worker rebuilds them as views: the cost is one copy of those
small tensors, shared by all the workers. The block of a given set of storages is made once and reused by every
later worker (each evaluation starts new ones), its bytes copied again at each start, so that a worker sees the
data as it is when it starts, as a shared storage would show it.
"""

from __future__ import annotations

import io
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.reduction
import pickle
import threading
from collections import OrderedDict

import torch
import torch.multiprocessing
from torch.multiprocessing.reductions import reduce_storage, reduce_tensor

# Storages shared one descriptor each; the rest go in one block. Half of the fork server's limit: the
# worker's queues and multiprocessing's own descriptors take a few of the others.
OWN_FDS = multiprocessing.forkserver.MAXFDS_TO_SEND // 2
OWN_FROM = 1 << 20  # bytes: a smaller storage, among too many, is copied (a descriptor kept open here costs more)
ALIGN = 64  # bytes: each storage's start in the block, enough for any dtype (and a cache line)

_loading = threading.local()  # the storages of the arguments being unpickled, in the worker
_blocks: OrderedDict[tuple[int, ...], tuple] = OrderedDict()  # (storages, offsets, block, (its views, theirs))
_BLOCKS_KEPT = 4  # a run's training and evaluation sets, and some margin


class _SettingAside(multiprocessing.reduction.ForkingPickler):
    """ForkingPickler (torch's reductions and multiprocessing's: a queue's pipes still go as descriptors) that
    pickles each CPU storage as its index in `storages` instead of sharing it. The pickle's memo sees a storage
    once, however many tensors view it."""

    def __init__(self, file):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self.dispatch_table[torch.UntypedStorage] = self._set_aside
        self.dispatch_table[torch.Tensor] = self._tensor

    def _tensor(self, t: torch.Tensor):
        """A plain CPU tensor as its storage and view (torch's reduce_tensor, less its TypedStorage: a third of
        the time); any other tensor as torch pickles it."""
        if (t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad or t.is_quantized
                or t.is_conj() or t.is_neg()):
            return reduce_tensor(t)
        return _rebuild_tensor, (t.untyped_storage(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    def _set_aside(self, storage: torch.UntypedStorage):
        if storage.device.type != "cpu" or storage.nbytes() == 0:
            return reduce_storage(storage)  # torch's refusal (CUDA, meta) or its empty storage: no descriptor
        self.storages.append(storage)
        return _storage, (len(self.storages) - 1,)


def _rebuild_tensor(storage: torch.UntypedStorage, offset: int, size: tuple, stride: tuple, dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _storage(index: int) -> torch.UntypedStorage:
    return _loading.storages[index]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _block(packed: list[torch.UntypedStorage]) -> tuple[list[int], torch.UntypedStorage]:
    """One storage holding the bytes of `packed` (offsets, block), made once for these storages (kept alive
    by the entry, so that their ids name them) and filled again at each call."""
    key = tuple(id(s) for s in packed)
    if (found := _blocks.get(key)) is None or any(a is not b for a, b in zip(found[0], packed, strict=True)):
        offsets, end = [], 0
        for s in packed:
            offsets.append(end)
            end += -(-s.nbytes() // ALIGN) * ALIGN
        block = torch.UntypedStorage(end)
        whole = _bytes(block)
        views = [whole[at:at + s.nbytes()] for s, at in zip(packed, offsets, strict=True)], [_bytes(s) for s in packed]
        found = _blocks[key] = (packed, offsets, block, views)
        while len(_blocks) > _BLOCKS_KEPT:
            _blocks.popitem(last=False)
    _blocks.move_to_end(key)
    _, offsets, block, (into, source) = found
    torch._foreach_copy_(into, source)
    return offsets, block


class PackedArgs:
    """Pickled (with ForkingPickler, to a new worker) as its value's pickle with the storages set aside, the
    OWN_FDS largest of them shared one descriptor each and the rest in one block."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        buf = io.BytesIO()
        pickler = _SettingAside(buf)
        pickler.dump(self.value)
        storages = pickler.storages
        if len(storages) <= OWN_FDS or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            return _unpickle, (buf.getvalue(), storages, None, [], range(len(storages)))
        order = sorted(range(len(storages)), key=lambda i: storages[i].nbytes(), reverse=True)
        own = [i for i in order[:OWN_FDS - 1] if storages[i].nbytes() >= OWN_FROM]
        rest = order[len(own):]
        offsets, block = _block([storages[i] for i in rest])
        where = own + rest  # storage index of each rebuilt one, in that order
        return _unpickle, (buf.getvalue(), [storages[i] for i in own], block,
                           [(at, storages[i].nbytes()) for i, at in zip(rest, offsets, strict=True)], where)


def _unpickle(data: bytes, own: list, block, spans: list[tuple[int, int]], where: list[int]):
    rebuilt = own + [block[at:at + n] for at, n in spans]  # views of the block
    storages = [None] * len(rebuilt)
    for i, s in zip(where, rebuilt, strict=True):
        storages[i] = s
    _loading.storages = storages
    try:
        return pickle.loads(data)
    finally:
        _loading.storages = None


class WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A fork server's process whose arguments travel as one PackedArgs."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_args"], state["_kwargs"] = PackedArgs((self._args, self._kwargs)), None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._args, self._kwargs = self._args


class WorkerContext(multiprocessing.context.ForkServerContext):
    """multiprocessing's forkserver context whose processes are WorkerProcess."""

    Process = WorkerProcess
