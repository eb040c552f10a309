"""Preflight doctor: is this world fit to train? `python -m train.doctor [--config X] [key=value ...]`

Runs alone (one process) or under torchrun / the launcher (`python -m train.launch --doctor ...`),
with the same config as training. Every rank checks what it can see; rank 0 prints one table:
the world (ranks, nodes, devices per node), an all-reduce's correctness on every rank and its bus
bandwidth, GPU health and NCCL version, the network transport NCCL chose (InfiniBand/RoCE or plain TCP
sockets), /dev/shm, the checkpoint directory (writable, room), and the
rendezvous endpoint. A failed row names the rank and host and what to fix; the exit code is 1 then.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass

from train.errors import EXIT_USAGE

SHM_MIN_GIB = 1.0


@dataclass
class Row:
    check: str
    ok: bool
    result: str
    where: str = "-"  # "rank R on HOST", or "-" for the whole world


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _local_checks(cfg, denv, device, host: str) -> list[Row]:
    """What one rank can see of its node; the node's first local rank does the per-node checks."""
    import torch

    where = f"rank {denv.rank} on {host}"
    rows = []
    if device.type == "cuda":
        try:
            free, total = torch.cuda.mem_get_info(device)
            a = torch.randn(1024, 1024, device=device)
            ok = bool(torch.isfinite(a @ a).all()) and torch.allclose((a @ torch.eye(1024, device=device)), a)
            name = torch.cuda.get_device_name(device)
            rows.append(Row("gpu", ok, f"{name}, {_gib(free)} free of {_gib(total)}, matmul "
                            + ("ok" if ok else "WRONG: replace or reset this GPU"), where))
        except RuntimeError as e:
            rows.append(Row("gpu", False, f"{type(e).__name__}: {str(e).splitlines()[0]}: check nvidia-smi", where))
    if denv.local_rank != 0:
        return rows
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    rows.append(Row("/dev/shm", shm >= SHM_MIN_GIB * 2**30, _gib(shm) + (
        "" if shm >= SHM_MIN_GIB * 2**30 else
        f" (< {SHM_MIN_GIB:g} GiB: loader workers and NCCL need more: docker --shm-size=8g, "
        "or a memory-backed emptyDir at /dev/shm)"), where))
    rows.append(_checkpoint_dir(cfg, where))
    return rows


def _checkpoint_bytes(cfg) -> int:
    """Model + optimizer state of the configured model, roughly: what one checkpoint takes (the model is
    built on the meta device: no memory, no time)."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        params = sum(p.numel() for p in cfg.task_class(cfg.task, cfg.seed).model().parameters())
    return params * 4 * (3 if cfg.optim.name == "adamw" else 2)


def _checkpoint_dir(cfg, where: str) -> Row:
    path = cfg.run_dir / "checkpoints"
    probe = path / f".doctor-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        return Row("checkpoint-dir", False, f"{path} is not writable ({e.strerror or e}): fix its permissions or "
                   "set run.dir to a writable (shared) path", where)
    free = shutil.disk_usage(path).free
    need = (cfg.checkpoint.keep + 1) * _checkpoint_bytes(cfg)
    ok = free >= need
    return Row("checkpoint-dir", ok, f"{path} writable, {_gib(free)} free" + (
        "" if ok else f", fewer than the {_gib(need)} that checkpoint.keep={cfg.checkpoint.keep} needs: free space "
        "or lower checkpoint.keep"), where)


def _rendezvous(host: str) -> Row | None:
    from train.launch.rendezvous import port_status

    endpoint = os.environ.get("RDZV_ENDPOINT") or os.environ.get("PET_RDZV_ENDPOINT")
    if not endpoint and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if not endpoint:
        return None
    ok, what = port_status(endpoint)
    return Row("rendezvous", ok, what, f"rank {os.environ.get('RANK', 0)} on {host}")


def _rdma() -> str:
    """What NCCL's InfiniBand/RoCE transport would find here: the verbs library and RDMA devices."""
    try:
        ctypes.CDLL("libibverbs.so.1")
        lib = "libibverbs loads"
    except OSError:
        lib = "no libibverbs (install rdma-core's libibverbs1 ibverbs-providers)"
    devices = sorted(os.path.basename(d) for d in glob.glob("/sys/class/infiniband/*"))
    return f"{lib}, RDMA devices: {', '.join(devices) or 'none'}"


def _nccl_log_setup() -> str:
    """NCCL reports the network it picks only at INFO level: send that (INIT and NET only) to a file of
    this process's own, so the doctor's output stays the table. Before the first NCCL communicator."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"doctor-nccl.{socket.gethostname()}.{os.getpid()}.log")
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=path)
    return path


UNREACHABLE = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel")  # interfaces other nodes cannot reach


def _transport(backend: str, nccl_log: str | None, where: str, nodes: int = 1) -> Row:
    """The network between nodes: NCCL's choice from its log ("Using network IB" / "NET/Socket"), said plainly
    when it is TCP sockets (slow across nodes; fine on one node, where NCCL uses NVLink/PCIe), and a FAIL with
    the fix when the sockets are on an interface the other nodes cannot reach (loopback, a container bridge)."""
    rdma = _rdma()
    if backend != "nccl":
        return Row("transport", True, f"{backend}: TCP sockets (CPU backend; NCCL's InfiniBand/RoCE is for GPUs); "
                   f"{rdma}", where)
    text = ""
    if nccl_log and os.path.exists(nccl_log):
        with open(nccl_log, errors="replace") as f:
            text = f.read()
        os.unlink(nccl_log)
    found = re.findall(r"Using network (\w+)", text) or re.findall(r"NET/(IB|Socket)\b", text)
    net = found[-1] if found else "unknown"
    # "NET/Socket : Using [0]eth0:10.1.2.3<0> [1]docker0:172.17.0.1<0>" (also "Bootstrap : Using eth0:...")
    ifaces = re.findall(r"\[\d+\](\w[\w.-]*):([\w.:]+)<", " ".join(re.findall(r"NET/Socket : Using (.*)", text)))
    bad = [f"{name} ({addr})" for name, addr in ifaces if name.startswith(UNREACHABLE)]
    if nodes > 1 and bad:
        return Row("transport", False, f"NCCL picked {', '.join(bad)}, which the other nodes cannot reach: set "
                   "NCCL_SOCKET_IFNAME to the interface the nodes share (the one `ip route get <rendezvous host>` "
                   "names, e.g. NCCL_SOCKET_IFNAME=eth0)", where)
    if net == "IB":
        return Row("transport", True, f"NCCL network IB (InfiniBand/RoCE verbs); {rdma}", where)
    if net == "Socket":
        has_devices = not rdma.endswith("none")
        return Row("transport", not has_devices, "NCCL network Socket: TCP sockets, not InfiniBand/RoCE; " + rdma + (
            ": RDMA devices exist but NCCL does not use them: unset NCCL_IB_DISABLE, set NCCL_IB_HCA to them "
            "(e.g. NCCL_IB_HCA=mlx5) and mount /dev/infiniband into the container" if has_devices else
            " (slow between nodes: for InfiniBand/RoCE install rdma-core and mount /dev/infiniband)"), where)
    return Row("transport", True, f"NCCL network {net} (a plugin, or not reported); {rdma}", where)


def _all_reduce(device, world: int, rank: int) -> tuple[bool, float, int]:
    """(correct here, bus bandwidth in bytes/s, message bytes): sum of (rank+1), then a timed loop."""
    import torch
    import torch.distributed as dist

    t = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(t)
    correct = bool((t == world * (world + 1) / 2).all())
    nbytes = (64 if device.type == "cuda" else 8) * 2**20
    buf = torch.ones(nbytes // 4, device=device)
    for _ in range(2):
        dist.all_reduce(buf)
    iters = 10 if device.type == "cuda" else 4
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    # nccl-tests' bus bandwidth: what each link carries in a ring all-reduce
    busbw = nbytes / seconds * (2 * (world - 1) / world) if world > 1 else nbytes / seconds
    return correct, busbw, nbytes


def run(cfg, denv) -> int:
    import torch
    import torch.distributed as dist

    from train.parallel import distributed

    host = socket.gethostname()
    nccl_log = _nccl_log_setup() if cfg.dist.backend in ("nccl", "auto") and torch.cuda.is_available() else None
    device = distributed.setup(denv, cfg.dist.backend, cfg.dist.timeout_s)
    try:
        rows = _local_checks(cfg, denv, device, host)
        if denv.local_rank == 0 and (rdzv := _rendezvous(host)):
            rows.append(rdzv)
        correct, busbw, nbytes = _all_reduce(device, denv.world_size, denv.rank)
        if denv.local_rank == 0:
            rows.append(_transport(dist.get_backend(), nccl_log, f"rank {denv.rank} on {host}", denv.nodes))
        elif nccl_log and os.path.exists(nccl_log):
            os.unlink(nccl_log)
        if not correct:
            rows.append(Row("all-reduce", False, "wrong sum: check this rank's GPU and network (NCCL_DEBUG=INFO)",
                            f"rank {denv.rank} on {host}"))
        mine = {"host": host, "rank": denv.rank, "device": str(device), "correct": correct, "busbw": busbw,
                "rows": rows, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
        everyone = [None] * denv.world_size
        dist.all_gather_object(everyone, mine)
        backend = dist.get_backend()
    finally:
        distributed.teardown()
    if denv.rank != 0:
        return 0
    hosts = sorted({e["host"] for e in everyone})
    per_node = denv.local_world_size
    kind = everyone[0]["device"].split(":")[0]
    table = [Row("world", True, f"{denv.world_size} rank(s) on {len(hosts)} node(s), {per_node} {kind} "
                 f"device(s) per node, backend {backend}")]
    good = sum(e["correct"] for e in everyone)
    table.append(Row("all-reduce", good == denv.world_size, f"correct on {good}/{denv.world_size} ranks"))
    table.append(Row("bus-bandwidth", True, f"{min(e['busbw'] for e in everyone) / 1e9:.2f} GB/s "
                     f"({nbytes // 2**20} MiB all-reduce, slowest rank)"))
    if everyone[0]["nccl"]:
        table.append(Row("nccl", True, everyone[0]["nccl"]))
    for e in everyone:
        table.extend(e["rows"])
    width = max(len(r.where) for r in table)
    print(f"{'check':16s} {'ok':4s} {'where':{width}s} result")
    for r in table:
        print(f"{r.check:16s} {'ok' if r.ok else 'FAIL':4s} {r.where:{width}s} {r.result}")
    failed = [r for r in table if not r.ok]
    if failed:
        print(f"doctor: {len(failed)} check(s) failed; fix the FAIL rows above", file=sys.stderr)
        return 1
    print("doctor: all checks passed")
    return 0


def main(argv: list[str] | None = None) -> int:
    from train import config
    from train.config import ConfigError

    args = config.parse_args(argv, prog="python -m train.doctor", description=(
        "Preflight doctor: is this world fit to train? Alone or under the launcher (python -m train.launch --doctor), "
        "with the training config: every rank checks what it sees, rank 0 prints one table, exit 1 on a FAIL row."))
    try:
        cfg = config.load(args.config, args.overrides)
        from train.parallel import distributed

        denv = distributed.detect()
        return run(cfg, denv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    code = main()
    if "train.parallel.distributed" in sys.modules:  # see train.parallel.distributed.exit_process()
        sys.modules["train.parallel.distributed"].exit_process(code)
    sys.exit(code)
