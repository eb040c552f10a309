"""docker-compose.yml's nodes and profiles, read without an engine."""
from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"


def _interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, over a loaded file."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, op, default = m[1], m[2], m[3] or ""
            if op == ":-":
                return env.get(name) or default
            return env.get(name, default if op == "-" else "")

        return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, value)
    return value


def _compose(env: dict[str, str] | None = None) -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def _profile(name: str) -> dict[str, dict]:
    return {n: s for n, s in _compose()["services"].items() if name in s.get("profiles", [])}


def test_compose_topology():
    compose = _compose()
    gpu, cpu = _profile("gpu"), _profile("cpu")
    assert set(compose["services"]) == set(gpu) | set(cpu), "every service is a node of one variant"
    assert len(gpu) == len(cpu) >= 2
    for nodes, has_gpus in ((gpu, True), (cpu, False)):
        first = next(iter(nodes))
        commands = set()
        for name, s in nodes.items():
            env = s["environment"]
            assert env["RDZV_ENDPOINT"].split(":")[0] == first, "c10d rendezvous at the first node's service"
            assert env["NNODES"].split(":")[-1] == str(len(nodes))
            assert s.get("restart") in ("on-failure", "always", "unless-stopped") or s.get("deploy", {}).get(
                "restart_policy"), f"{name}: a killed node must come back"
            assert s.get("shm_size") or s.get("ipc") == "host", name
            # the launcher's stop budget ends inside compose's grace period (else SIGKILL before the save)
            grace = sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])",
                                                                                      s["stop_grace_period"]))
            assert int(env["STOP_TIMEOUT"]) < grace, f"{name}: STOP_TIMEOUT {env['STOP_TIMEOUT']} >= {grace} s"
            if s.get("read_only"):  # as on Kubernetes; the image keeps HOME and its caches in /tmp
                assert any(t.split(":")[0] == "/tmp" for t in s.get("tmpfs", [])), name
            assert any(v.split(":")[1] == "/runs" for v in s["volumes"]), "the shared run volume"
            devices = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            assert bool(devices) == has_gpus, name
            assert all("gpu" in d["capabilities"] for d in devices)
            commands.add(tuple(s["command"]))
        assert len(commands) == 1, "every node runs the same training command"
    assert {tuple(s["command"]) for s in gpu.values()} == {tuple(s["command"]) for s in cpu.values()}
    named = [v.split(":")[0] for s in compose["services"].values() for v in s["volumes"]]
    assert set(named) <= set(compose.get("volumes", {})), "a named volume, shared by the nodes"


def test_a_usage_error_exits_0_on_compose_alone_and_its_line_says_so(monkeypatch, capsys):
    """restart: on-failure restarts every exit but 0 (no Docker restart policy filters exit codes), so a usage error
    (exit 2: a bad key, a refused relaunch) would be restarted for ever: x-env's USAGE_EXIT_CODE=0 ends such a node
    once, its one line, the last, saying so. Only 2 is mapped, only where the variable is set: the plain launcher,
    SLURM and Kubernetes keep exit 2. (On the real engine: tests/systems/test_compose.py.)"""
    from train.launch import launcher as launch

    for name, s in _compose()["services"].items():
        assert s["restart"] == "on-failure" and s["environment"]["USAGE_EXIT_CODE"] == "0", name
    for path in [*(ROOT / "k8s").rglob("*.yaml"), *(ROOT / "slurm").rglob("*"), ROOT / "Dockerfile", ROOT / "Makefile"]:
        assert path.is_dir() or "USAGE_EXIT_CODE" not in path.read_text(), path

    monkeypatch.setattr(launch.Signals, "install", lambda self: None)  # pytest's own signal handlers stay
    bad_key = ["--dry-run", "--config", "configs/default.yaml", "train.no_such_key=1"]
    monkeypatch.delenv("USAGE_EXIT_CODE", raising=False)
    assert launch.main(bad_key) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: unknown config key 'train.no_such_key'")
    monkeypatch.setenv("USAGE_EXIT_CODE", "0")
    assert launch.main(bad_key) == 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: unknown config key 'train.no_such_key'") and last.endswith(
        "; exit 0 in place of 2 (USAGE_EXIT_CODE=0): not restarted"), last
    for rc in (0, 1, 75, 137):  # done, failed, stopped after a checkpoint, killed: as they were
        monkeypatch.setattr(launch, "_main", lambda argv, rc=rc: rc)
        assert launch.main([]) == rc
    monkeypatch.undo()
    monkeypatch.setattr(launch.Signals, "install", lambda self: None)
    for value in ("1", "75", "256", "x"):  # 1 and the requeue code would be restarted: refused, exit 2
        monkeypatch.setenv("USAGE_EXIT_CODE", value)
        assert launch.main(["--dry-run", "--config", "configs/default.yaml"]) == 2, value
        assert capsys.readouterr().err.startswith("error: USAGE_EXIT_CODE must be an exit code from 0 to 255"), value
