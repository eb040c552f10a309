"""Run a container launcher's nodes as local processes: the image's entrypoint, a node's environment and
mounts, its peers' names resolved to 127.0.0.1 (one free port per node and container port)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, TINY
from tests.image_build import dockerfile_instructions


def required(what: str, reason: str) -> None:
    """Skip with the reason on a user's machine; under CI (CI=true) a missing prerequisite is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is required under CI: {reason}")
    pytest.skip(f"{what}: {reason}")


def tool(name: str) -> str:
    """A command-line tool the dev requirements install (beside this interpreter, else on PATH)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        required(name, "not installed: make dev (requirements-dev.txt) installs it")
    return found


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last:]


def image_exec(instruction: str) -> list[str]:
    """The final stage's ENTRYPOINT or CMD, which must be in exec (JSON) form."""
    values = [rest for word, rest in final_stage(dockerfile_instructions()) if word == instruction]
    assert values, f"the Dockerfile has no {instruction}"
    value = json.loads(values[-1])
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{instruction} is not exec form"
    return value


def workdir() -> str:
    return [rest for word, rest in final_stage(dockerfile_instructions()) if word == "WORKDIR"][-1]


def local_argv(argv: list[str]) -> list[str]:
    """The image's `python` is this interpreter."""
    assert argv and argv[0] in ("python", "python3", "/opt/venv/bin/python"), argv
    return [PY, *argv[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Addresses:
    """Host names of the nodes -> 127.0.0.1, each (node, port) -> its own free local port."""

    def __init__(self, names: list[str]):
        self.names = sorted(names, key=len, reverse=True)
        self.ports: dict[tuple[str, int], int] = {}
        alternatives = "|".join(re.escape(n) for n in self.names)
        self.pattern = re.compile(rf"(?<![\w.-])({alternatives})(?::(\d+))?(?![\w.-])")

    def port(self, name: str, port: int) -> int:
        return self.ports.setdefault((name, int(port)), free_port())

    def __call__(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            return "127.0.0.1" + (f":{self.port(m[1], int(m[2]))}" if m[2] else "")

        return self.pattern.sub(sub, text)


def map_paths(text: str, mounts: dict[str, Path]) -> str:
    """Container paths (mount points) in an argument or value -> the local folders standing in for them."""
    if not mounts:
        return text
    targets = {t.rstrip("/"): str(folder) for t, folder in mounts.items()}
    alternatives = "|".join(re.escape(t) for t in sorted(targets, key=len, reverse=True))
    # One pass, so a replacement (a folder under the host's /tmp) is not itself replaced by the /tmp mount.
    return re.sub(rf"(?<![\w./-])({alternatives})(?=/|$|[\s,:])", lambda m: targets[m[1]], text)


@dataclass
class Node:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)


def run_nodes(nodes: list[Node], timeout: float = 420, hosts=None, stagger: float = 0.0) -> dict[str, tuple[int, str]]:
    """Start every node and wait for all; one still running at the end (a failure, the timeout) is killed
    with its whole process group (torchrun and its workers). With hosts (tests/hosts.py, one per node, made
    with introduce=False), node K runs on host K, last node first, `stagger` seconds apart, and a host's
    name resolves on the others only once its node has started (as a pod's DNS name does)."""
    handles = []
    order = list(range(len(nodes)))
    if hosts is not None:
        assert len(hosts) == len(nodes)
        order.reverse()
    try:
        for k in order:
            node = nodes[k]
            out = node.log.open("w")
            handles.append(out)
            argv = node.argv
            if hosts is not None:
                if k != order[0]:
                    time.sleep(stagger)
                for other in hosts:
                    if other is not hosts[k]:
                        other.knows(hosts[k])
                argv = hosts[k].argv(argv)
            node.proc = subprocess.Popen(argv, cwd=ROOT, env=node.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.proc.wait()
        for out in handles:
            out.close()
    return {node.name: (node.proc.returncode, node.log.read_text(errors="replace")) for node in nodes}


def tiny(argv: list[str]) -> list[str]:
    """A node's command with the tiny CPU overrides appended (they win over the config file)."""
    return [*argv, *TINY]


def quoted(argv: list[str]) -> str:
    return shlex.join(argv)
