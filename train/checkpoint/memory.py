"""Checkpoints in host memory (checkpoint.memory_every: N): every N steps each node copies its ranks' state into
files under checkpoint.memory_dir (/dev/shm: host memory, a tmpfs), which outlive a worker that crashes. A restart
on the same hosts (torchrun's, a relaunch) resumes from the newest state all ranks can read, in memory or on disk
(train/checkpoint/resume.py's decision), and loses at most N steps instead of everything since the last save.

A share is what one rank holds of the model and optimizer: the whole state under DDP (every rank the same), a
rank's shards under FSDP, a place in the shard group under HSDP (every replica the same). A node writes each share
its ranks hold once, from its lowest rank that holds it, with every rank's RNG states and loss window (the rest of
a disk checkpoint's trainer.pt) in its record. A share that no other node holds (FSDP over several nodes) is also
sent to the next node, which keeps a copy: a host lost and replaced recovers from its peers' copies.

Each share has two slots: a copy goes to the older one, whose record is deleted first and written last (a
copy cut short never counts). The files are mode 0600 in a folder of mode 0700 (memory_folder: one per user and
run directory); a run that ends (finished, or stopped with its disk checkpoint) removes its folder, and a start
removes the states of this run newer than the one it resumed and the folders of runs whose directory or
checkpoints are gone. A memory copy never replaces a durable save: a stop still ends in a disk checkpoint.

The bound: a node holds two copies of each of its shares (and of each peer's, FSDP over nodes), at most half of
the memory folder's free space when the first copy is made; above it the tier is off for the launch, in one line.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.checkpoint.dcp_io import buffers_copied, tensor_state
from train.checkpoint.storage import MEMORY_ID, memory_folder, memory_records
from train.config import Config, shard_ranks

FORMAT = 1
ALIGN = 64  # each tensor's offset in a share's bytes: any dtype's view of them is aligned


@dataclass
class Layout:
    """How a run's state is split into shares: the same at save and load, or the memory states do not serve."""
    world_size: int
    per_node: int  # ranks a node (torchrun's LOCAL_WORLD_SIZE; ranks are numbered node by node)
    shards: int  # the ranks a parameter is spread over (config.shard_ranks): shares 0 .. shards-1
    strategy: str

    @classmethod
    def of(cls, cfg: Config, world_size: int, per_node: int) -> Layout:
        per_node = max(1, min(per_node, world_size))
        return cls(world_size, per_node, shard_ranks(cfg, world_size, per_node), cfg.dist.strategy)

    def key(self, rank: int) -> int:
        return rank % self.shards

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def nodes(self) -> int:
        return max(1, self.world_size // self.per_node)

    def node_ranks(self, node: int) -> range:
        return range(node * self.per_node, min((node + 1) * self.per_node, self.world_size))

    def writer(self, rank: int) -> bool:
        """Whether this rank writes its share on its node: the node's lowest rank holding that share."""
        return rank == min(r for r in self.node_ranks(self.node(rank)) if self.key(r) == self.key(rank))

    def peer_copies(self) -> list[tuple[int, int, int]]:
        """(from rank, to rank, share): each share only one node holds goes to the next node's lowest rank."""
        if self.nodes() < 2:
            return []
        out = []
        for key in range(self.shards):
            holders = sorted({self.node(r) for r in range(self.world_size) if self.key(r) == key})
            if len(holders) == 1:
                src = min(r for r in self.node_ranks(holders[0]) if self.key(r) == key)
                out.append((src, self.node_ranks((holders[0] + 1) % self.nodes())[0], key))
        return out

    def same(self, record: dict) -> bool:
        return (record.get("world_size"), record.get("shards"), record.get("strategy"), record.get("per_node")) == \
            (self.world_size, self.shards, self.strategy, self.per_node)


@dataclass
class MemoryState:
    """A resume candidate in host memory: a step whose every share some node holds."""
    step: int
    holders: dict  # share -> the nodes holding it at this step

    @property
    def name(self) -> str:
        return f"host memory step_{self.step:08d}"

    def __str__(self) -> str:
        return self.name


def memory_id(cfg: Config, create: bool) -> str | None:
    """Which run the memory states belong to (<run_dir>/checkpoints/memory_id): states of a run directory that was
    deleted and started again, or whose checkpoints were removed, are another run's."""
    path = cfg.run_dir / "checkpoints" / MEMORY_ID
    try:
        return path.read_text().strip() or None
    except OSError:
        pass
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{MEMORY_ID}.tmp{os.getpid()}")
    tmp.write_text(os.urandom(8).hex() + "\n")
    os.replace(tmp, path)
    return path.read_text().strip()


def listing(cfg: Config, run_id: str | None, layout: Layout, rank: int) -> list[tuple[int, int, int]]:
    """(step, share, node) of the complete shares in this node's memory folder that belong to this run and layout."""
    if run_id is None:
        return []
    out = []
    for step, key, _, path in memory_records(memory_folder(Path(cfg.checkpoint.memory_dir), cfg.run_dir)):
        record = _read_record(path)
        if record and record.get("memory_id") == run_id and layout.same(record) and record.get("step") == step:
            out.append((step, key, layout.node(rank)))
    return out


def complete_steps(found: list[tuple[int, int, int]], layout: Layout) -> tuple[MemoryState | None, int | None]:
    """The newest step whose every share some node holds, and the newest step newer than it that is incomplete."""
    holders: dict[int, dict[int, set[int]]] = {}
    for step, key, node in found:
        holders.setdefault(step, {}).setdefault(key, set()).add(node)
    complete, incomplete = None, None
    for step in sorted(holders, reverse=True):
        if set(holders[step]) >= set(range(layout.shards)):
            complete = MemoryState(step, {k: sorted(v) for k, v in holders[step].items()})
            break
        incomplete = incomplete if incomplete is not None else step
    return complete, incomplete


def _read_record(path: Path) -> dict | None:
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a record cut short or of another version: no state
        return None
    return found if isinstance(found, dict) and found.get("format") == FORMAT else None


def _dumps(record: dict) -> bytes:
    data = io.BytesIO()
    torch.save(record, data)
    return data.getvalue()


def _loads(data: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's local tensor) of a nested state dict, in its order."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _leaves(v, f"{prefix}{k}/")
        elif torch.is_tensor(v):
            out.append((f"{prefix}{k}", v.to_local() if isinstance(v, DTensor) else v))
    return out


def _index(leaves: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, tuple, int]], int]:
    index, offset = [], 0
    for name, t in leaves:
        index.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return index, offset


def _mapped(path: Path, nbytes: int, write: bool) -> torch.Tensor:
    """A file's bytes as a uint8 tensor mapped from it (write: changes go to the file; made with mode 0600)."""
    if write:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            if nbytes:  # the pages now: a full tmpfs is an OSError here, not a SIGBUS in the copy
                os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    storage = torch.UntypedStorage.from_file(str(path), shared=write, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _view(buf: torch.Tensor, dtype: str, shape: tuple, offset: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    return buf[offset:offset + n].view(dt).view(shape)


class HostMemory:
    """This rank's part of the memory tier: its copies (save), and reading a state back (load)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, per_node: int, log, load_group=None) -> None:
        self.cfg, self.rank, self.log = cfg, rank, log
        self.every = cfg.checkpoint.memory_every
        self.layout = Layout.of(cfg, world_size, per_node)
        self.folder = memory_folder(Path(cfg.checkpoint.memory_dir), cfg.run_dir)
        self.run_id: str | None = None  # set by the resume decision (resume.agree)
        self.on = self.every > 0
        self.saved_step: int | None = None
        self._checked = False
        # The copies' collectives in a group of their own (they run in a thread of their own); a load, before any
        # copy, in the checkpointer's
        self._group = load_group
        if world_size > 1 and self.every > 0:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
        self._jobs: queue.SimpleQueue | None = None
        self._pending: futures.Future | None = None
        self._copied: futures.Future | None = None  # this rank's copy made: the optimizer's next step may change it
        self._hook = None
        self.error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.on and step % self.every == 0

    # ---- saving
    def save(self, state, trainer: dict, mine: dict) -> None:
        """Copy this rank's share at state.step, off the step's path: the copy runs while the next step's forward
        and backward do (its optimizer step waits for it); `trainer` is a disk checkpoint's trainer.pt less
        the ranks' own parts, `mine` this rank's RNG states and loss window."""
        self.wait()
        tensors, rest = tensor_state(state.model, state.optimizer, state.step)
        tensors["model"] = buffers_copied(tensors.get("model", {}), state.model)  # a forward changes them
        leaves = _leaves(tensors)
        if not self._checked and not self._fits(leaves):
            return
        if self._hook is None:
            self._hook = state.optimizer.register_step_pre_hook(lambda *_: self._wait_copied())
        if self._jobs is None:  # one daemon thread: a copy stuck in a collective never holds up the exit
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=lambda jobs=self._jobs: [job() for job in iter(jobs.get, None)], daemon=True,
                             name="memory-copy").start()
        self.saved_step = state.step
        self._copied = futures.Future()
        record = {"format": FORMAT, "memory_id": self.run_id, "step": state.step, "key": self.layout.key(self.rank),
                  "world_size": self.layout.world_size, "shards": self.layout.shards, "per_node": self.layout.per_node,
                  "strategy": self.layout.strategy, "trainer": trainer | {"rest": rest}}
        self._pending = done = futures.Future()
        copied = self._copied

        def job() -> None:
            try:
                self._copy(leaves, record, mine, copied)
            finally:
                done.set_result(None)

        self._jobs.put(job)

    def _fits(self, leaves: list) -> bool:
        """The bound, checked once, agreed by all ranks: two copies of what this node holds, at most half of the
        memory folder's free space."""
        self._checked = True
        _, nbytes = _index(leaves)
        held = 2 * nbytes * (int(self.layout.writer(self.rank)) + sum(1 for _, dst, _ in self.layout.peer_copies()
                                                                       if dst == self.rank))
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            free = shutil.disk_usage(self.folder).free
            problem = None if held <= free / 2 else (f"needs {held / 2**30:.2f} GiB for two copies, and "
                                                     f"{self.folder.parent} has {free / 2**30:.2f} GiB free")
        except OSError as e:
            problem = f"cannot use {self.cfg.checkpoint.memory_dir} ({e.strerror})"
        if self.rank == 0 and problem is None and self.run_id is None:
            try:  # this run's first copy: its states are this run's from now on
                self.run_id = memory_id(self.cfg, create=True)
            except OSError as e:
                problem = f"cannot write {self.cfg.run_dir / 'checkpoints'} ({e.strerror})"
        problems = [(problem, self.run_id)]
        if self._group is not None:
            problems = [None] * self.layout.world_size
            dist.all_gather_object(problems, (problem, self.run_id), group=self._group)
        self.run_id = problems[0][1]
        problems = [p for p, _ in problems]
        if found := next(((r, p) for r, p in enumerate(problems) if p), None):
            self.on = False
            if self.rank == 0:
                self.log.warning(f"checkpoint.memory_every={self.every}: copies in host memory are off for this "
                                 f"launch, only disk checkpoints serve a restart: rank {found[0]}'s node {found[1]} "
                                 f"(they may take half of it). Give {self.cfg.checkpoint.memory_dir} more room "
                                 f"(docker: --shm-size), or set checkpoint.memory_dir")
            return False
        self._write_owner()
        return True

    def _write_owner(self) -> None:
        """Which run the folder's states are of (_remove_stale reads it)."""
        tmp = self.folder / f".owner.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"run_dir": str(self.cfg.run_dir.resolve()), "memory_id": self.run_id}))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.folder / "owner.json")

    def _copy(self, leaves: list, record: dict, mine: dict, copied: futures.Future) -> None:
        try:
            try:
                ranks = [mine]
                if self._group is not None:
                    ranks = [None] * self.layout.world_size
                    dist.all_gather_object(ranks, mine, group=self._group)
                record["trainer"] = record["trainer"] | {"rng": [r["rng"] for r in ranks],
                                                         "window": [r["window"] for r in ranks]}
                payload = None
                if self.layout.writer(self.rank):
                    payload = self._write(record["key"], leaves, record)
            finally:
                copied.set_result(None)
            self._peer_copies(payload, record["step"])
        except BaseException as e:  # reported by the training thread at the next copy or at the end
            self.error = e

    def _write(self, key: int, leaves: list, record: dict) -> tuple[torch.Tensor, bytes]:
        index, nbytes = _index(leaves)
        buf, slot = self._slot_buffer(key, nbytes)
        for (_, dtype, shape, offset), (_, t) in zip(index, leaves, strict=True):
            _view(buf, dtype, shape, offset).copy_(t)
        return buf, self._publish(key, slot, record | {"index": index, "bytes": nbytes})

    def _slot_buffer(self, key: int, nbytes: int) -> tuple[torch.Tensor, int]:
        """The older slot of a share, its record deleted first: from here it does not count until written."""
        slots = {slot: step for step, k, slot, _ in memory_records(self.folder) if k == key}
        older = min((0, 1), key=lambda s: slots.get(s, -1))
        for _, k, slot, path in memory_records(self.folder):
            if k == key and slot == older:
                path.unlink(missing_ok=True)
        return _mapped(self.folder / f"share{key}.slot{older}.bin", nbytes, write=True), older

    def _publish(self, key: int, slot: int, record: dict) -> bytes:
        data = _dumps(record)
        path = self.folder / f"share{key}.slot{slot}.step_{record['step']:08d}.pt"
        tmp = self.folder / f".{path.name}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return data

    def _peer_copies(self, payload, step: int) -> None:
        """Each share only one node holds, to the next node (Layout.peer_copies), which keeps it as its own."""
        pairs = [(s, d, k) for s, d, k in self.layout.peer_copies() if self.rank in (s, d)]
        if not pairs:
            return
        slots: dict[int, int] = {}

        def slot_buffer(nbytes: int, key: int) -> torch.Tensor:
            buf, slots[key] = self._slot_buffer(key, nbytes)
            return buf

        sends = [(dst, *payload) for src, dst, _ in pairs if src == self.rank]
        recvs = [(src, lambda n, key=key: slot_buffer(n, key)) for src, dst, key in pairs if dst == self.rank]
        keys = [key for _, dst, key in pairs if dst == self.rank]
        for key, (_, record) in zip(keys, self._exchange(sends, recvs), strict=True):
            if record.get("step") == step:
                self._publish(key, slots[key], record)

    def _exchange(self, sends: list[tuple[int, torch.Tensor, bytes]],
                  recvs: list[tuple[int, Callable[[int], torch.Tensor]]]) -> list[tuple[torch.Tensor, dict]]:
        """Shares between ranks (gloo): each send is (to rank, the share's bytes, its record as saved), each receive
        (from rank, the buffer of n bytes to receive into). Their sizes first, then the bytes; the received
        (bytes, record), in the order of `recvs`."""
        def run(ops: list) -> None:
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

        sizes = [torch.zeros(2, dtype=torch.int64) for _ in recvs]
        run([dist.P2POp(dist.isend, torch.tensor([buf.numel(), len(rec)], dtype=torch.int64), dst, group=self._group)
             for dst, buf, rec in sends]
            + [dist.P2POp(dist.irecv, n, src, group=self._group) for (src, _), n in zip(recvs, sizes, strict=True)])
        got = [(into(int(n[0])), torch.empty(int(n[1]), dtype=torch.uint8))
               for (_, into), n in zip(recvs, sizes, strict=True)]
        ops = []
        for dst, buf, rec in sends:
            ops += [dist.P2POp(dist.isend, buf.contiguous(), dst, group=self._group),
                    dist.P2POp(dist.isend, _as_tensor(rec), dst, group=self._group)]
        for (src, _), (buf, rec) in zip(recvs, got, strict=True):
            ops += [dist.P2POp(dist.irecv, buf, src, group=self._group),
                    dist.P2POp(dist.irecv, rec, src, group=self._group)]
        run(ops)
        return [(buf, _loads(rec)) for buf, rec in got]

    def _wait_copied(self) -> None:
        if self._copied is not None:
            futures.wait([self._copied])
            self._copied = None

    def wait(self) -> None:
        """Until the copy in flight (and its peer copies) is done; raises its error."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"a copy in host memory failed: {err}") from err

    # ---- loading
    def load(self, state, candidate: MemoryState) -> dict:
        """Fill the model's and optimizer's tensors of `state` with its share at the candidate's step (read from
        this node, or sent by a node that holds it); the record's trainer dict (as a disk checkpoint's trainer.pt).
        Called on every rank."""
        key, here = self.layout.key(self.rank), self.layout.node(self.rank)
        mine = None if here in candidate.holders.get(key, []) else candidate.holders[key][0]
        sent = self._sends(candidate)
        got = self._receive(candidate.step, key, mine, sent)
        if got is not None:
            self.log.info(f"{candidate}: this node lacks share {key}; a copy came from rank "
                          f"{self.layout.node_ranks(mine)[0]}'s node")
        record, buf = got if got is not None else self._local(key, candidate.step)
        tensors, rest = tensor_state(state.model, state.optimizer, state.step)
        leaves = dict(_leaves(tensors))
        names = [name for name, *_ in record["index"]]
        if sorted(names) != sorted(leaves):
            raise ValueError(f"holds other tensors than this run's ({len(names)} against {len(leaves)})")
        for name, dtype, shape, offset in record["index"]:
            t = leaves[name]
            if tuple(t.shape) != tuple(shape) or str(t.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"{name} is {dtype}{list(shape)} there and {t.dtype}{list(t.shape)} here")
            t.copy_(_view(buf, dtype, shape, offset))
        return {"tensors": tensors, "rest": rest, "trainer": record["trainer"]}

    def _local(self, key: int, step: int) -> tuple[dict, torch.Tensor]:
        for s, k, slot, path in memory_records(self.folder):
            if s == step and k == key:
                record = _read_record(path)
                if record is not None and record.get("memory_id") == self.run_id:
                    return record, _mapped(self.folder / f"share{key}.slot{slot}.bin", record["bytes"], write=False)
        raise ValueError("is gone from this node's host memory")

    def _sends(self, candidate: MemoryState) -> list[tuple[int, int]]:
        """(to rank, share) of the ranks whose node lacks their share, which this rank serves: the lowest rank
        of the first node holding it."""
        out = []
        for r in range(self.layout.world_size):
            key = self.layout.key(r)
            nodes = candidate.holders.get(key, [])
            if nodes and self.layout.node(r) not in nodes and self.rank == self.layout.node_ranks(nodes[0])[0]:
                out.append((r, key))
        return out

    def _receive(self, step: int, key: int, src_node: int | None, sends: list) -> tuple[dict, torch.Tensor] | None:
        """The shares sent between nodes for a load (a host replaced): this rank's, if its node lacks it."""
        if self._group is None:
            return None
        outgoing = []
        for dst, k in sends:
            record, buf = self._local(k, step)
            outgoing.append((dst, buf, _dumps(record)))
        recvs = [] if src_node is None else [(self.layout.node_ranks(src_node)[0],
                                              lambda n: torch.empty(n, dtype=torch.uint8))]
        got = self._exchange(outgoing, recvs)
        return (got[0][1], got[0][0]) if got else None

    # ---- housekeeping
    def keep_up_to(self, step: int | None) -> None:
        """After the resume: this run's states newer than the resumed step go (a rollback's, a fall back's, an
        incomplete one's), and so do other runs' and this run's other layouts'; a node's lowest rank does it."""
        if self.rank != self.layout.node_ranks(self.layout.node(self.rank))[0]:
            return
        _remove_stale(self.folder.parent, self.folder)
        for s, _, _, path in memory_records(self.folder):
            record = _read_record(path)
            if step is None or s > step or record is None or record.get("memory_id") != self.run_id \
                    or not self.layout.same(record):
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """The run ended with its disk checkpoint (finished, or stopped): its states in memory go."""
        self.wait()
        if self._group is not None:
            dist.barrier(group=self._group)
        if self.rank == self.layout.node_ranks(self.layout.node(self.rank))[0]:
            shutil.rmtree(self.folder, ignore_errors=True)


def _remove_stale(parent: Path, ours: Path) -> None:
    """Memory folders of this user's runs whose run directory, or its memory_id, is gone or another's: a killed
    run's, never resumed."""
    prefix = ours.name.rsplit("-", 1)[0] + "-"
    try:
        folders = [p for p in parent.iterdir() if p.name.startswith(prefix) and p != ours]
    except OSError:
        return
    for folder in folders:
        if not (folder / "owner.json").exists() and _age(folder) < 600:
            continue  # a run's first copy, being made
        try:
            owner = json.loads((folder / "owner.json").read_text())
            current = (Path(owner["run_dir"]) / "checkpoints" / MEMORY_ID).read_text().strip()
        except (OSError, ValueError, KeyError, TypeError):
            current, owner = None, {}
        if current is None or current != owner.get("memory_id"):
            shutil.rmtree(folder, ignore_errors=True)


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
