"""The doctor's transport row names the fix for sockets on an unreachable interface."""
from __future__ import annotations

import subprocess

from tests.conftest import PY, ROOT, clean_env


def doctor(*args: str, launcher: bool = True, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    if launcher:
        cmd = [PY, "-m", "train.launch", "--doctor", "--nproc-per-node=2", "--", *args]
    else:
        cmd = [PY, "-m", "train.doctor", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(**(extra_env or {})), capture_output=True, text=True,
                          timeout=300)


def test_the_transport_row_names_the_fix_for_sockets_on_an_unreachable_interface(tmp_path):
    """NCCL's log (NCCL_DEBUG=INFO, its documented lines; no GPU here to make NCCL write them) read by the doctor:
    sockets on loopback or a container bridge between nodes FAIL with NCCL_SOCKET_IFNAME; on one node they are
    fine; sockets where RDMA devices exist name NCCL_IB_HCA / NCCL_IB_DISABLE (the devices are this machine's)."""
    from train import doctor

    def row(lines: list[str], nodes: int):
        log = tmp_path / "nccl.log"
        log.write_text("\n".join(f"node1:123:123 [0] NCCL INFO {line}" for line in lines) + "\n")
        return doctor._transport("nccl", str(log), "rank 0 on node1", nodes)

    bridge = ["Bootstrap : Using docker0:172.17.0.1<0>", "NET/Plugin: No plugin found (libnccl-net.so)",
              "NET/Socket : Using [0]docker0:172.17.0.1<0>", "Using network Socket"]
    bad = row(bridge, nodes=2)
    assert not bad.ok and "NCCL picked docker0 (172.17.0.1)" in bad.result and "NCCL_SOCKET_IFNAME" in bad.result
    assert row(bridge, nodes=1).ok  # one node: NCCL goes over NVLink/PCIe, sockets only bootstrap
    good = row(["NET/Socket : Using [0]eth0:10.1.2.3<0>", "Using network Socket"], nodes=2)
    assert "NCCL_SOCKET_IFNAME" not in good.result and "TCP sockets" in good.result
    if good.ok:  # no RDMA device here: the row says how to get InfiniBand
        assert "install rdma-core" in good.result
    else:
        assert "NCCL_IB_HCA" in good.result and "NCCL_IB_DISABLE" in good.result
    ib = row(["NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.1.2.3<0>", "Using network IB"], nodes=2)
    assert ib.ok and "NCCL network IB" in ib.result
