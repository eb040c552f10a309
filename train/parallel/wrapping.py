"""How the model is spread over the ranks, in one place: DDP or FSDP2, and activation checkpointing.

- DDP (dist.strategy=ddp): every rank holds the whole model, its gradients and its optimizer state;
  gradients are all-reduced in buckets during the backward. One process alone trains the model itself: DDP
  would all-reduce each gradient with nobody (the same bits) and, under torch.compile, split the compiled graph
  at each bucket, which slows the step.
- FSDP2 (dist.strategy=fsdp, torch.distributed.fsdp.fully_shard): every rank holds 1/world of each
  parameter, gradient and optimizer state (DTensors). Each of the task's blocks (Task.blocks) is a unit:
  its parameters are all-gathered just before its forward (and again before its backward when
  dist.reshard_after_forward frees them; never the last block's, whose backward follows at once), its gradients
  reduce-scattered after its backward; the root unit holds the rest (embeddings, heads). bf16/fp16
  (train.precision) all-gathers and computes in that dtype and reduces gradients in fp32; the sharded parameters
  and the optimizer stay fp32. BatchNorm layers are units of their own that all-gather in fp32 (their statistics
  are fp32).
- HSDP (dist.strategy=hsdp): FSDP2 as above on a 2-D mesh, (replicas, dist.shard_size): each parameter is
  sharded over the ranks of a group (by default a node's: its all-gathers and reduce-scatters stay on the node's
  links) and each group holds a whole replica; after the reduce-scatter in its group, each shard of the gradients
  is all-reduced with the same shard of the other groups. Everything else is FSDP's: the units, the precision,
  the meta-device materialization, the CPU ranks' buffers.
- Activation checkpointing (train.activation_checkpointing, any strategy): each block keeps only its
  input, and its forward is run again in the backward to get its activations.
- A model built on the meta device (no memory) is given its memory here (materialize): under FSDP after
  sharding, so that a rank only ever holds its shards; under DDP before wrapping. Its values come from the
  task's init_parameter, one whole tensor at a time from a generator seeded by `seed`, of which each rank
  keeps its shard: the same weights whatever the strategy and the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.config import Config, ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: Config, device: torch.device):
    """Where the task's forward and loss run: autocast to train.precision (off in fp32)."""
    p = cfg.train.precision
    return torch.autocast(device.type, dtype=DTYPES[p], enabled=p != "fp32")


def wrap(cfg: Config, task, model: nn.Module, device: torch.device, shard_ranks: int = 0) -> nn.Module:
    """The model as it trains: DDP(model) (one process: `model` itself), or `model` itself, sharded in place by
    fully_shard (FSDP2; HSDP: over groups of `shard_ranks`, config.shard_ranks).
    `model` stays what checkpoints hold and evaluation runs, under any strategy."""
    blocks = list(task.blocks(model))
    if not all(isinstance(b, nn.Module) for b in blocks):
        raise ConfigError(f"task {cfg.task_name}: blocks() must return submodules of the model (nn.Module)")
    if cfg.train.activation_checkpointing:
        if not blocks:
            raise ConfigError(f"train.activation_checkpointing: task {cfg.task_name} names no blocks to "
                              "recompute (define its blocks(model), see train/task.py)")
        for block in blocks:
            _checkpoint(block)
    d = cfg.dist
    if d.strategy == "ddp" and torch.distributed.get_world_size() == 1:
        return model
    if d.strategy == "ddp":
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   bucket_cap_mb=d.bucket_cap_mb, gradient_as_bucket_view=d.gradient_as_bucket_view,
                   static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _hsdp_mesh(device, shard_ranks) if d.strategy == "hsdp" else None  # None: fully_shard's, every rank
    p = cfg.train.precision
    mp = MixedPrecisionPolicy(param_dtype=None if p == "fp32" else DTYPES[p], reduce_dtype=torch.float32)
    if p != "fp32":
        # BatchNorm's running statistics are fp32 buffers, which torch's batch_norm does not take beside bf16/fp16
        # weights ("expected scalar type BFloat16 but found Float" at the first step): each BatchNorm is a unit of
        # its own whose weights stay fp32 (its input stays in the low precision, as under DDP's autocast).
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            fully_shard(norm, mesh=mesh, reshard_after_forward=d.reshard_after_forward, mp_policy=fp32)
    for block in blocks:  # without blocks: one unit, the whole model gathered at once (no memory saved)
        # The last block's backward comes right after its forward (only the head and loss between): freeing its
        # parameters would only gather them again at once (torchtitan's policy too).
        fully_shard(block, mesh=mesh, reshard_after_forward=d.reshard_after_forward and block is not blocks[-1],
                    mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=d.reshard_after_forward, mp_policy=mp)
    if device.type == "cpu":
        _one_block_at_a_time(model)
    return model


def _hsdp_mesh(device: torch.device, shard_ranks: int):
    """HSDP's 2-D mesh: ranks r*shard_ranks .. (r+1)*shard_ranks-1 shard the model (a node's ranks, in torchrun's
    and srun's numbering, when shard_ranks is the ranks of a node), and each of those groups is a replica."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    return init_device_mesh(device.type, (world // shard_ranks, shard_ranks), mesh_dim_names=("replicate", "shard"))


def shard_group(model: nn.Module) -> tuple[int, int]:
    """(the ranks this rank's shards are spread over, its place among them): (1, 0) for a model that is not
    sharded (DDP, one process), whose replicas hold the whole model; the ranks that share a place hold the
    same shards (HSDP's replicas)."""
    from torch.distributed.tensor import DTensor

    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if param is None:
        return 1, 0
    mesh = param.device_mesh
    dim = mesh.mesh_dim_names.index("shard") if mesh.mesh_dim_names and "shard" in mesh.mesh_dim_names else 0
    return mesh.size(dim), mesh.get_local_rank(dim)


def _one_block_at_a_time(model: nn.Module) -> None:
    """On CPU ranks, FSDP2 holds no more than the block it is working on.

    FSDP2 keeps memory to overlap its collectives with compute on a GPU's streams. On CPU (gloo) nothing
    overlaps: each collective is done before the next line runs, so that memory buys nothing. Two buffers go:
    - the backward prefetch: the next block's parameters, gathered while this one's backward runs. Each unit
      prefetches only itself, which it already holds: nothing.
    - the reduce-scatter input, a copy of a block's whole gradients that FSDP2 keeps until the next block's
      reduce-scatter (for the GPU's allocator). It is freed as soon as its reduce-scatter returns.
    Each of the two adds a block to the peak of a step. GPU runs keep FSDP2's defaults: there the overlap is the
    point."""
    for unit in _units(model):
        unit.set_modules_to_backward_prefetch([unit])
        unit.set_custom_reduce_scatter(_FreeingReduceScatter())


class _FreeingReduceScatter:
    """FSDP2's reduce-scatter (torch.distributed.fsdp's ReduceScatter interface), which frees its input once done.
    Only where the collective is done when the call returns (gloo, called without async_op, as FSDP2 does)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = torch.distributed.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                        async_op=async_op)
        if work is None:  # done: nothing reads the input again
            input_tensor.untyped_storage().resize_(0)
        return work


def on_meta(model: nn.Module) -> bool:
    """Whether the task built its model on the meta device (any of its tensors is on it)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize(model: nn.Module, task, device: torch.device, seed: int, skip: Collection[str] = ()) -> None:
    """Give a meta-built model (plain, or sharded by fully_shard) its memory on `device` and its initial
    values: for each parameter and buffer in the model's order (a tied weight once), every rank draws the
    whole tensor on the CPU with task.init_parameter and keeps its shard. At most one whole tensor is held at
    a time; the generator is the CPU's, so GPUs and CPUs, one rank or many, DDP or FSDP get the same bits.
    `skip`: the tensors a checkpoint or init_from overwrites whole before the first step (a resume), given
    memory only: drawing them is most of a large model's start, for nothing."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter held by several modules (tied weights)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, key))
    model.to_empty(device=device)
    for places in (p for p in shared.values() if len(p) > 1):  # to_empty gives each module a new one: tie again
        first = places[0][0]._parameters[places[0][1]]
        for module, key in places[1:]:
            if module._parameters[key] is not first:
                module._parameters[key] = first
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if name in skip:
                continue
            full = torch.empty(t.shape, dtype=t.dtype)  # a DTensor's shape is the whole tensor's
            task.init_parameter(name, full, generator)
            if isinstance(t, DTensor):  # every rank holds the same whole tensor: each keeps its slice, no message
                t.copy_(distribute_tensor(full.to(device), t.device_mesh, t.placements, src_data_rank=None))
            else:
                t.copy_(full)
    if on_meta(model):  # a tensor that model.to_empty did not reach
        left = next(n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta)
        raise ConfigError(f"task {type(task).__name__}: {left} is still on the meta device after the trainer gave the "
                          f"model its memory: make it a parameter or buffer of the model")


def whole_model(task, device: torch.device, seed: int) -> nn.Module:
    """The task's model whole on `device`, with its initial values (a meta-built one materialized): for one
    process outside training (a benchmark, a test, an inference script)."""
    model = task.model()
    if on_meta(model):
        materialize(model, task, device, seed)
        return model
    return model.to(device)


def no_sync(wrapped: nn.Module):
    """A micro-step that only accumulates gradients: no all-reduce (DDP) or reduce-scatter (FSDP)."""
    if isinstance(wrapped, DDP):
        return wrapped.no_sync()
    return _fsdp_no_sync(wrapped) if sharded(wrapped) else contextlib.nullcontext()  # one process: nothing to sync


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)  # FSDP2 keeps the unsharded gradients until the synced micro-step
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard(model: nn.Module) -> None:
    """FSDP: free every gathered parameter. A forward without a backward (an evaluation) leaves the root unit
    gathered, and every unit under dist.reshard_after_forward=false: held through the save and into the next
    step otherwise. Nothing under DDP."""
    for unit in _units(model):
        unit.reshard()


def _units(model: nn.Module) -> list[nn.Module]:
    """The modules fully_shard made units of (none under DDP)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def replicated(model: nn.Module) -> bool:
    """Whether `model` is wrapped by DDP (several processes, dist.strategy=ddp)."""
    return isinstance(model, DDP)


def sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by fully_shard (its parameters are DTensors): FSDP or HSDP."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """The model's parameters (whole: a DTensor's numel is that of the whole tensor), and those this rank holds."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)


def _checkpoint(block: nn.Module) -> None:
    """Recompute `block`'s forward in the backward (torch.utils.checkpoint, non-reentrant; it replays the
    RNG, so dropout draws the same masks). Its forward is replaced on the instance, so the state dict's
    keys, and with them the checkpoints, are those of the model without it."""
    forward = block.forward

    def contexts():
        return contextlib.nullcontext(), _norm_stats_frozen(block)

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    block.forward = checkpointed


@contextlib.contextmanager
def _norm_stats_frozen(block: nn.Module):
    """During the recomputation: BatchNorm layers leave their running statistics as they are (momentum 0),
    so a recomputed batch does not count twice."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved, strict=True):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)
