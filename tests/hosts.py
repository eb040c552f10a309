"""Real hosts on one machine: "make N hosts, run this on host K".

Each host is a network namespace with its own address (198.18.0.0/15, reserved for network tests), its own
hostname (`unshare --uts`) and its own /etc/hosts (/etc/netns/NAME/hosts, which `ip netns exec` mounts
over /etc/hosts), joined by a veth pair to a bridge of its own. The file system stays shared, as on a
cluster with a shared file system. A host knows its own hostname; which other names it resolves is up
to the test (`knows`), so a scenario can add a name only later.

    def test_x(make_hosts):
        a, b = make_hosts("n0", "n1")          # both know each other's names
        p = b.popen([...], log=tmp/"b.log")      # runs inside b's namespace, hostname n1
        a.knows(b)                               # or a.knows("alias", b.addr): later, in place

Everything is removed when the test ends, even when it fails: processes still running on the hosts
(their whole process groups), the namespaces, the bridge, the hosts files and the firewall rule. Names
carry a random tag, so parallel runs do not collide. Without root or `ip` the tests skip saying why;
under CI=true they fail instead (tests/multinode.py's `required`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT
from tests.multinode import required

NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    name: str  # its hostname
    addr: str
    netns: str
    own_memory: bool = False  # a /dev/shm of its own (a tmpfs): host memory no other host sees
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def hosts_file(self) -> Path:
        return NETNS_ETC / self.netns / "hosts"

    def knows(self, other: Host | str, addr: str | None = None) -> None:
        """Make a name resolve on this host: another host's hostname, or any name -> addr. Appended in
        place (the file is bind-mounted into running processes, so they see it at once)."""
        name, addr = (other.name, other.addr) if isinstance(other, Host) else (other, addr)
        with self.hosts_file.open("a") as f:
            f.write(f"{addr}\t{name}\n")

    def argv(self, argv: list[str]) -> list[str]:
        """argv run inside this host: its network namespace, its /etc/hosts, its hostname (and with own_memory
        its /dev/shm: what argv left there is printed when it ends, `/dev/shm at the end: NAMES`)."""
        if self.own_memory:
            return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                    "sh", "-c", 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname "$0" || exit 125; "$@"; '
                    'rc=$?; echo "/dev/shm at the end: $(ls -A /dev/shm | tr "\n" " ")"; exit $rc', self.name, *argv]
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def argv_with_sys(self, argv: list[str]) -> list[str]:
        """argv run inside this host like argv(), but seeing this machine's /sys: `ip netns exec` mounts a
        /sys of the namespace's own, without /sys/fs/cgroup, and slurmd refuses to start without cgroups."""
        return ["unshare", "--mount", "--uts", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$2" && ns=$3 && shift 3 && exec nsenter --net="$ns" "$@"',
                self.name, str(self.hosts_file), self.name, f"/run/netns/{self.netns}", *argv]

    def popen(self, argv: list[str], env: dict, log: Path, **kw) -> subprocess.Popen:
        """Start argv on this host in a session of its own, stdout and stderr into log."""
        with log.open("w") as out:
            proc = subprocess.Popen(self.argv(argv), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def crash(self) -> None:
        """The host is lost at once: every process on it SIGKILLed (its network stays, answering nothing)."""
        for pid in _ip("netns", "pids", self.netns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


class Hosts:
    """N hosts on one bridge. Use make_hosts (the fixture), which removes them afterwards."""

    def __init__(self, names: tuple[str, ...], introduce: bool = True, own_memory: bool = False):
        self.tag = secrets.token_hex(3)
        self.bridge = f"br{self.tag}"
        self.hosts: list[Host] = []
        self.rule: list[str] | None = None
        subnet = secrets.randbelow(512)  # one /24 of 198.18.0.0/15 (bridges are separate L2 segments anyway)
        prefix = f"198.{18 + subnet // 256}.{subnet % 256}"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            self._allow_bridge()
            for k, name in enumerate(names):
                host = Host(name, f"{prefix}.{k + 1}", f"h{self.tag}-{k}", own_memory)
                self.hosts.append(host)
                _ip("netns", "add", host.netns)
                (NETNS_ETC / host.netns).mkdir(parents=True, exist_ok=True)
                host.hosts_file.write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{host.addr}\t{name}\n")
                outer, inner = f"v{self.tag}{k}", f"w{self.tag}{k}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip("link", "set", inner, "netns", host.netns)
                _ip("-n", host.netns, "link", "set", inner, "name", "eth0")
                _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
            if introduce:
                for a in self.hosts:
                    for b in self.hosts:
                        if a is not b:
                            a.knows(b)
        except BaseException:
            self.remove()
            raise

    def _allow_bridge(self) -> None:
        """Once br_netfilter is loaded (Docker's engine loads it and sets FORWARD to DROP), bridged frames
        pass iptables' FORWARD chain: let this bridge's own traffic through, and only it."""
        try:
            on = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"
        except OSError:
            on = False
        if not on or not shutil.which("iptables"):  # Docker's engine needs iptables: no iptables, no DROP
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        self.rule = rule

    def __getitem__(self, k: int) -> Host:
        return self.hosts[k]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def remove(self) -> None:
        """Stop what still runs on the hosts, then remove the namespaces, the bridge, the files, the rule."""
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
        for host in self.hosts:
            # Anything else left inside (a worker in a session of its own) dies with its namespace's pids.
            pids = _ip("netns", "pids", host.netns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", host.netns, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        if self.rule:
            subprocess.run(["iptables", "-D", *self.rule], capture_output=True)


def _usable() -> str | None:
    """Why real hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 util-linux)"
    return None


def make_hosts_fixture():
    """The make_hosts fixture (tests/conftest.py): make_hosts("n0", "n1", introduce=True, own_memory=False) ->
    Hosts, removed after the test whatever happens."""
    made: list[Hosts] = []

    def make(*names: str, introduce: bool = True, own_memory: bool = False) -> Hosts:
        if why := _usable():
            required("real hosts (network namespaces)", why)
        try:
            hosts = Hosts(names, introduce, own_memory)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            required("real hosts (network namespaces)", str(e))
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.remove()
