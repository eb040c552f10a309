"""Where am I, who are my peers: launch-environment detection, process-group setup and teardown.

Three launch environments are recognised, in this order:
- torchrun (also a PyTorchJob or compose running torchrun): RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT;
- `srun` with one task per process: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS inside a job step;
- nothing: a single process (world size 1).
A group is always created, a one-process group in the last case, so the rest of the code has no
"am I distributed?" branches.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.errors import ConfigError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | single

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_master(env: Mapping[str, str]) -> str:
    """The first host of the allocation, as `scontrol show hostnames` expands it."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if nodelist and all(c not in nodelist for c in "[,"):
        return nodelist
    raise ConfigError(f"cannot find the first node of SLURM_JOB_NODELIST={nodelist!r}: set MASTER_ADDR")


def detect(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launch environment; a partial one is a ConfigError naming what is missing."""
    env = os.environ if env is None else env
    present = [v for v in TORCHRUN_VARS if v in env]
    if any(v in env for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):  # MASTER_* alone may be a user's export
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise ConfigError(f"incomplete torchrun environment: {', '.join(present)} set but "
                              f"{', '.join(missing)} missing; launch with torchrun or unset them")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        launcher = "torchrun"
        addr, port = env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    elif "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        # Inside `srun`, one task per process. A batch script alone (no step) is not a launch.
        need = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID")
        missing = [v for v in need if v not in env]
        if missing:
            raise ConfigError(f"incomplete SLURM environment: {', '.join(missing)} missing")
        rank, world, local_rank = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        local_world = int(per_node.split("(")[0].split(",")[0])
        launcher = "slurm"
        addr = env.get("MASTER_ADDR") or _slurm_master(env)
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + _int(env, "SLURM_JOB_ID") % 20000
    else:
        return DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
    if not 0 <= rank < world or not 0 <= local_rank < max(local_world, 1):
        raise ConfigError(f"inconsistent launch environment: rank {rank}, local rank {local_rank}, "
                          f"world size {world}, local world size {local_world}")
    return DistEnv(rank, local_rank, world, local_world, addr, port, launcher)


# Where a scheduler or container runtime says GPUs were handed to this process.
GPU_ALLOCATION_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK",
                       "SLURM_GPUS_PER_NODE", "SLURM_GPUS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
# The oldest NVIDIA driver each CUDA major version of the torch wheels runs on (Linux).
MIN_DRIVER = {"13": "580", "12": "525", "11": "450"}


def gpus_allocated(env: Mapping[str, str]) -> str | None:
    """The variable that says GPUs were allocated to this process (NAME=value), or None."""
    for name in GPU_ALLOCATION_VARS:
        value = env.get(name, "").strip()
        none = ("", "void", "none", "-1", "(null)", "n/a") + (("0",) if name.startswith("SLURM_") else ())
        if name == "NVIDIA_VISIBLE_DEVICES":  # "all": an image's default (ours, the CUDA images), no grant
            none += ("all",)
        if value.lower() not in none:
            return f"{name}={value}"
    return None


def cuda_index(denv: DistEnv, count: int) -> int:
    """The CUDA device of this rank among the `count` it sees. torchrun shows every GPU of the node to
    every rank: LOCAL_RANK picks one. A scheduler that binds GPUs per task (srun --gpus-per-task=1,
    --gpu-bind) shows each task its own, fewer than the tasks on the node: the first of them is its."""
    if denv.local_rank < count:
        if denv.launcher == "slurm" and count < denv.local_world_size:
            return 0
        return denv.local_rank
    if denv.launcher == "slurm" and count >= 1:
        return 0
    raise ConfigError(f"local rank {denv.local_rank} has no GPU: this node has {count}; "
                      f"start at most {count} processes per node (--nproc-per-node)")


def device_for(denv: DistEnv, env: Mapping[str, str] | None = None) -> torch.device:
    """This rank's CUDA device; CPU without CUDA, unless GPUs were allocated to it: then CUDA that does
    not work is an error (in one line), not a silent start on CPU."""
    env = os.environ if env is None else env
    if not torch.cuda.is_available():
        if (allocated := gpus_allocated(env)) is not None:
            raise ConfigError(f"GPUs were allocated ({allocated}) but CUDA is not usable here: {_cuda_problem()}; "
                              "check `nvidia-smi`, or clear that variable to train on CPU")
        return torch.device("cpu")
    return torch.device("cuda", cuda_index(denv, torch.cuda.device_count()))


def _cuda_problem() -> str:
    cuda = torch.version.cuda
    if not cuda:
        return f"this torch ({torch.__version__}) is a CPU build; install the CUDA wheels (requirements.txt)"
    try:
        torch.cuda.init()
        why = "no CUDA device is visible"
    except Exception as e:  # the driver's own words: missing, too old, no device
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    need = MIN_DRIVER.get(cuda.split(".")[0])
    return (f"{why} (torch {torch.__version__} is built for CUDA {cuda}"
            + (f", which needs NVIDIA driver >= {need})" if need else ")"))


def setup(denv: DistEnv, backend: str, timeout_s: float) -> torch.device:
    """Bind the device and create the process group (nccl on CUDA, gloo on CPU)."""
    device = device_for(denv)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend=nccl needs CUDA GPUs; use dist.backend=gloo (or auto) on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl" and os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):  # the flight recorder's dump folder
        os.makedirs(os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    timeout = datetime.timedelta(seconds=timeout_s)
    if denv.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", denv.master_addr)
        os.environ.setdefault("MASTER_PORT", str(denv.master_port))
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            kwargs["store"] = _round_store(denv, timeout)
        else:
            kwargs["init_method"] = "env://"
        try:
            dist.init_process_group(backend, rank=denv.rank, world_size=denv.world_size, timeout=timeout, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            raise (shared_gpu(str(e)) or e) from None
    return device


def shared_gpu(nccl_error: str) -> ConfigError | None:
    """NCCL refuses two ranks on one GPU (more tasks than GPUs, without a GPU bound to each task): the
    usage error to report instead of the communicator's failure, or None for any other error."""
    m = re.search(r"Duplicate GPU detected : rank (\d+) and rank (\d+) both on CUDA device (\w+)", nccl_error)
    if m is None:
        return None
    return ConfigError(f"ranks {m[1]} and {m[2]} share one GPU (CUDA device {m[3]}) on {hostname()}: start at most "
                       "one process per GPU (--nproc-per-node), or bind one GPU to each task (srun --gpus-per-task=1 "
                       "or --gpu-bind=single:1)")


def _round_store(denv: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """The agent's store (plain torchrun shares one store server with the workers of every round), under
    a prefix of this group's own. torch's agent keeps that server across restarts, so without one the
    keys of a dead group (gloo's and NCCL's addresses) are read by the group that replaces it, which then
    connects to dead ranks (`connectFullMesh ... Connection refused`). Nothing the workers are given is
    unique to a group and the same on every node (the restart count differs on a node that joined
    later), so rank 0 makes a group id and hands it to each rank against a nonce of that rank's own: a
    key left by a dead group is never taken for this one's."""
    import uuid

    store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size, is_master=False, timeout=timeout,
                          multi_tenant=True)  # as torch's env:// makes it
    base, deadline = "ddp-template/group", time.monotonic() + timeout.total_seconds()
    if denv.rank == 0:
        group, pending = uuid.uuid4().hex, set(range(1, denv.world_size))
        while pending:
            for r in list(pending):
                if store.check([f"{base}/ack/{group}/{r}"]):
                    pending.discard(r)
                elif store.check([f"{base}/ask/{r}"]):  # maybe a dead group's: answered anyway, never acked
                    store.set(f"{base}/answer/{store.get(f'{base}/ask/{r}').decode()}", group)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"timed out forming the process group: ranks {sorted(pending)} did not join")
            time.sleep(0.02)
    else:
        nonce = uuid.uuid4().hex
        store.set(f"{base}/ask/{denv.rank}", nonce)
        group = store.get(f"{base}/answer/{nonce}").decode()  # waits up to the timeout
        store.set(f"{base}/ack/{group}/{denv.rank}", "1")
    return dist.PrefixStore(f"{base}/{group}/", store)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a worker process without Python's interpreter finalization.

    DDP keeps its gloo process group alive after destroy_process_group() (its worker threads are still
    running when the program ends; plain collectives' are not), and such a thread may be the one that frees
    the last collective's tensors. If that happens while Python finalizes,
    taking the GIL ends the thread with pthread_exit, whose unwinding through torch's C++ destructors
    calls std::terminate: "terminate called without an active exception", SIGABRT, after a run that
    succeeded (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> decref_pyobject ->
    take_gil -> PyThread_exit_thread, while the main thread is in Py_FinalizeEx). Everything is
    written and closed by now; what is left (loader workers) is freed first, the streams flushed."""
    release_loader_workers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def release_loader_workers() -> None:
    """End the loader workers of the DataLoader iterators nothing holds any more, and free their queues."""
    gc.collect()  # DataLoader iterators shut their worker processes down in their finalizers
    # Their queues' feeder threads end just after (closed, they were not joined): wait for them, a few ms,
    # so that the semaphores they hold are freed. Loader workers start from a fork server (train/parallel/data.py),
    # whose queues' semaphores multiprocessing's resource tracker follows: one still held here would be
    # reported as "leaked semaphore objects" when the process ends.
    deadline = time.monotonic() + 2.0
    for t in threading.enumerate():
        if t.name == "QueueFeederThread":
            t.join(max(0.0, deadline - time.monotonic()))


def sync_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics), as DDP does at the start of a forward."""
    if dist.get_world_size() > 1:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for buffers in by_dtype.values():  # one broadcast per dtype, not one per buffer (ResNet-50: 2 vs 159)
            flat = torch.cat([b.detach().reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            for b, v in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                b.detach().copy_(v.view_as(b))


def all_reduce_max(value: float, device: torch.device) -> float:
    if dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few Python numbers over all ranks (float64, so counts stay exact). One process returns them as they are:
    no trip through the GPU at a log step, while the GPU waits for the next step."""
    if dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def hostname() -> str:
    return socket.gethostname()


def _raised_in_loader(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if "/torch/utils/data/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def describe_failure(exc: BaseException, timeout_s: float) -> str | None:
    """A one-line reading of a collective's failure, or None when it is not one. The whole chain of causes
    is read: torch words one failure differently depending on where it surfaced (a DataLoader worker
    killed by a signal is `DataLoader worker (pid(s) N) exited unexpectedly`, the signal in its cause)."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(map(str, chain))
    if re.search(r"[Tt]imed out|[Tt]imeout", text):
        return (f"collective timed out after dist.timeout_s={timeout_s:g} s: another rank hung or died (see "
                f"its log in the run directory); raise dist.timeout_s if steps are legitimately slower")
    # Loader workers are children of their fork server (train/parallel/data.py), not of the rank, so torch sees their
    # end as "exited unexpectedly"; the signal is named where the chain of causes has it ("is killed by
    # signal: Killed", for a worker that is torch's own child).
    if re.search(r"DataLoader worker \(pid(?:\(s\))?[^)]*\) (is killed by signal|exited unexpectedly)", text):
        sig = next(iter(re.findall(r"is killed by signal: ?([^.\n]*)", text)), "")
        how = f"was killed ({sig}" if sig else "died (it exited unexpectedly"
        return (f"a DataLoader worker {how}; often the out-of-memory killer): lower "
                "data.num_workers or the batch size, or give the job more memory; --max-restarts lets torchrun "
                "restart the workers from the last checkpoint")
    if any(isinstance(e, (ConnectionError, EOFError)) and _raised_in_loader(e) for e in chain):
        # A worker that dies while it hands a batch over (its tensors pass through a connection to it)
        return ("a DataLoader worker died (its connection broke while it handed over a batch; often the "
                "out-of-memory killer): lower data.num_workers or the batch size, or give the job more memory; "
                "--max-restarts lets torchrun restart the workers from the last checkpoint")
    if re.search(r"Connection closed by peer|Connection reset|Broken pipe|NCCL error|DistNetworkError", text):
        return "a peer rank's connection broke: another rank died (see its log in the run directory)"
    return None
