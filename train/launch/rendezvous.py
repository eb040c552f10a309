"""The rendezvous endpoint, checked before torchrun starts: parsed, probed (up, refused, unresolvable), and
waited for, within the join timeout, while the first node is still starting.
"""

from __future__ import annotations

import errno
import ipaddress
import multiprocessing
import os
import socket
import sys
import time

from train.errors import EXIT_REQUEUE, ConfigError
from train.launch.forwarding import Signals


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); a bracketed IPv6 address ([fd00::1]:29400) loses its brackets, as in
    torchrun."""
    host, _, port = endpoint.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 2**16 or "[" in host or "]" in host:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (or [IPv6]:PORT), got {endpoint!r}")
    return host, int(port)


def rdzv_setting(conf: str | None, key: str) -> str | None:
    """One key=value of --rdzv-conf (the last one given), or None."""
    found = None
    for item in (conf or "").split(","):
        k, _, v = item.partition("=")
        if k.strip() == key:
            found = v.strip()
    return found


def check_conf(conf: str | None) -> None:
    """--rdzv-conf as torchrun reads it, on one node (--standalone, its own local rendezvous) as on several:
    KEY=VALUE items separated by commas, each with a key and a value (torchrun's own parse otherwise stops
    it with a traceback), and join_timeout a number of seconds."""
    if not (conf or "").strip():
        return
    for item in conf.split(","):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            what = (f"{item.strip()!r} has no =VALUE" if key.strip() else
                    f"{item.strip()!r} has no KEY" if item.strip() else "an item is empty (a stray comma)")
            raise ConfigError(f"--rdzv-conf (RDZV_CONF) must be KEY=VALUE items separated by commas (e.g. "
                              f"join_timeout=600,last_call_timeout=30), got {conf!r}: {what}")
    join_timeout(conf)


def join_timeout(conf: str | None) -> float:
    """The rendezvous join timeout (torchrun's default: 600 s), as --rdzv-conf join_timeout sets it."""
    value = rdzv_setting(conf, "join_timeout")
    try:
        return float(value) if value is not None else 600.0
    except ValueError:
        raise ConfigError(f"--rdzv-conf join_timeout must be a number of seconds, got {value!r}") from None


# What probe_endpoint finds: this host serves it (free here, or already a c10d store), it is another
# host's and answers, it is not up yet (no name, nothing listening: wait), or a local port held by
# something else (fail).
HOSTED, STORE, REACHABLE, NOT_YET, HELD = "hosted", "store", "reachable", "not-yet", "held"


def probe_endpoint(endpoint: str, timeout_s: float = 5.0) -> tuple[str, str, str | None]:
    """(kind, what, address) for a rendezvous HOST:PORT: free on this host, served by a c10d store (another
    agent of this job on this host), in use by something else, on another host and reachable, or not up
    yet. The address is this node's, as the rendezvous host sees it (None when unknown)."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return NOT_YET, f"{host} does not resolve yet ({e.strerror or e})", None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is free
        try:
            s.bind(addr)
            return HOSTED, f"{endpoint} is free on this host", addr[0]
        except OSError as e:
            if e.errno != errno.EADDRINUSE:  # not an address of this host: check it is reachable
                try:
                    with socket.create_connection(addr[:2], timeout=timeout_s) as c:
                        return REACHABLE, f"{endpoint} is reachable", c.getsockname()[0]
                except OSError as e2:
                    return NOT_YET, f"{endpoint} is not reachable yet ({e2.strerror or e2})", None
    # In use here: fine if it is a c10d store (another agent of this job), not if it is anything else.
    # A store client of something that accepts but never answers can hang past its timeout, so the
    # probe runs in a child process that is killed if it does not answer in time. A fork: the launcher
    # calls this before torchrun and any other thread (safe); the doctor calls it after its process group
    # started gloo's/NCCL's threads, and there a fork can hang in the child (CPython gh-112275, see
    # train/parallel/data.py): the kill below bounds it, at worst a wrong "in use by another program" row.
    def probe():
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the store client's C++ complaints are not news
        try:
            dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception:
            os._exit(1)
        os._exit(0)

    child = multiprocessing.get_context("fork").Process(target=probe, daemon=True)
    child.start()
    child.join(timeout_s + 1)
    if child.exitcode is None:
        child.kill()
        child.join()
    elif child.exitcode == 0:
        return STORE, f"{endpoint} is served by a c10d store on this host", addr[0]
    return HELD, (f"port {port} on {host} is in use by another program: choose another --rdzv-endpoint "
                  f"port, or stop what holds it (ss -ltnp 'sport = :{port}')"), None


def port_status(endpoint: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    """(ok, what) for a rendezvous HOST:PORT now (the doctor's row): see probe_endpoint."""
    kind, what, _ = probe_endpoint(endpoint, timeout_s)
    return kind in (HOSTED, STORE, REACHABLE), what


class NotUp(RuntimeError):
    """The rendezvous host did not come up within the join timeout: nothing was trained (exit 75)."""


def wait_for_rendezvous(opts: dict[str, str | None], signals: Signals, poll_s: float = 1.0) -> dict[str, str | None]:
    """Block until this node can join the rendezvous: it hosts it, or the host's name resolves and its
    port answers. A node started before the rendezvous host waits for it, within the join timeout, as
    torchrun itself would. Returns the options for torchrun: rdzv_conf, and local_addr, the address
    the other nodes reach this one at (from the route to the rendezvous host, not from the hostname).
    Raises RuntimeError (one line) for a local port held by another program or a host still not up at
    the deadline, Stopped on a stop signal."""
    endpoint, conf = opts["rdzv_endpoint"], opts["rdzv_conf"] or ""
    timeout = join_timeout(conf)
    deadline, said = time.monotonic() + timeout, None
    while True:
        signals.check()
        kind, what, local = probe_endpoint(endpoint)
        if kind == HELD:
            raise RuntimeError(what)
        if kind != NOT_YET:
            break
        if time.monotonic() >= deadline:
            raise NotUp(f"the rendezvous host is not up after {timeout:g} s: {what}; nothing was trained, so a "
                         f"retry loses nothing (exit {EXIT_REQUEUE}); if it stays down, start the first node, check "
                         "that its name resolves here and the port is open between nodes, or raise --rdzv-conf "
                         "join_timeout=SECONDS")
        if what != said:
            print(f"launch: waiting up to {timeout:g} s for the rendezvous host: {what}", file=sys.stderr, flush=True)
            said = what
        time.sleep(poll_s)
    signals.check()
    if said:
        print(f"launch: {what}", file=sys.stderr, flush=True)
    # torchrun hosts the store only where the endpoint's name is this machine's hostname or resolves to
    # its address; a node name that differs (an /etc/hosts alias, a SLURM NodeName, a service name)
    # would make the node that must host it wait as a client. The bind above has just shown it is ours.
    # (Not on a loopback address: several nodes of one machine may race for it, and torch's own guess,
    # which falls back to a client when the port is taken, handles that.)
    if kind == HOSTED and rdzv_setting(conf, "is_host") is None and not ipaddress.ip_address(
            local.split("%")[0]).is_loopback:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        try:
            ours = _matches_machine_hostname(split_endpoint(endpoint)[0])
        except OSError:  # this machine's own hostname does not resolve
            ours = False
        if not ours:
            conf = f"{conf},is_host=1" if conf else "is_host=1"
    return opts | {"rdzv_conf": conf, "local_addr": opts.get("local_addr") or local}
