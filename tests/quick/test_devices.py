"""The device each rank uses, and two ranks on one GPU refused."""
from __future__ import annotations

import pytest

from train.config import ConfigError
from train.parallel import distributed


def srun_task(local_id: int, tasks_per_node: int) -> distributed.DistEnv:
    """What srun gives task `local_id` of a node with `tasks_per_node` tasks (2 nodes)."""
    return distributed.detect({"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_PROCID": str(local_id),
                               "SLURM_LOCALID": str(local_id), "SLURM_NTASKS": str(2 * tasks_per_node),
                               "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x2)", "MASTER_ADDR": "n1"})


def torchrun_worker(local_rank: int, per_node: int) -> distributed.DistEnv:
    return distributed.detect({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(per_node),
                               "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_each_rank_uses_the_gpu_it_is_given():
    # srun --gpus-per-task=1 (--gpu-bind): every task sees one device, while SLURM_LOCALID runs 0..3
    assert [distributed.cuda_index(srun_task(i, 4), 1) for i in range(4)] == [0, 0, 0, 0]
    # srun with every GPU of the node visible to every task: the local id picks one
    assert [distributed.cuda_index(srun_task(i, 4), 4) for i in range(4)] == [0, 1, 2, 3]
    # torchrun shows every rank all GPUs of the node
    assert [distributed.cuda_index(torchrun_worker(i, 2), 2) for i in range(2)] == [0, 1]
    with pytest.raises(ConfigError, match="local rank 1 has no GPU: this node has 1"):
        distributed.cuda_index(torchrun_worker(1, 2), 1)


def test_two_ranks_on_one_gpu_are_named_in_one_usage_error():
    """More tasks than GPUs without a GPU bound to each task: NCCL's communicator refuses it at the
    process group's creation; the ranks sharing the GPU are the usage error (exit 2), not "a peer died".
    The error's text as torch raises it (DistBackendError, NCCL's last error appended); no GPU here."""
    text = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
            "NCCL_DEBUG=WARN for details), NCCL version 2.27.5\nncclInvalidUsage: This usually reflects invalid "
            "usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 3 and rank 1 both on CUDA device 1d000")
    error = distributed.shared_gpu(text)
    assert isinstance(error, ConfigError)
    assert str(error).startswith(f"ranks 3 and 1 share one GPU (CUDA device 1d000) on {distributed.hostname()}: ")
    assert distributed.shared_gpu("NCCL error in: ... remote process exited or there was a network error") is None
