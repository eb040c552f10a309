# The training image: the pinned PyTorch (CUDA, cuDNN and NCCL come with its wheels), train/ and
# configs/, and the shared launcher as entrypoint. Arguments after the image name are training arguments:
#
#   make docker-build                                   # -> ddp-template:<version in pyproject.toml>
#   docker run --rm --gpus all --shm-size 8g -v ddp-runs:/runs ddp-template:0.1.0 \
#       --config configs/default.yaml train.steps=200   # one node, one process per GPU
#
# Launcher options come from the environment (NNODES, NPROC_PER_NODE, RDZV_ENDPOINT, RDZV_ID,
# MAX_RESTARTS, or the PET_* ones the Kubeflow operator sets) or go first: `IMAGE --nnodes 2 ... --
# --config ...`. Runs are written under /runs (runs/ in the working directory points there).
#
# Base: plain Debian Python, not nvidia/cuda: the pinned torch wheels bring their own CUDA runtime,
# cuDNN and NCCL (the nvidia-* packages), so a CUDA base image would only add a second copy of them.
# The GPU driver is mounted at run time by the NVIDIA container toolkit (docker --gpus, the Kubernetes
# device plugin, enroot/pyxis); enroot and a default nvidia runtime inject it only when the image sets
# NVIDIA_VISIBLE_DEVICES (below; --gpus and the device plugin override it with the GPUs they grant).
# The CUDA 13 wheels need an NVIDIA driver >= 580 and a Turing or newer GPU (see docs/containers.md).
# Python: the same minor as CI (3.11), so pip resolves the same cp311 wheels of the same pins CI tests; but
# a later patch release than CI's 3.11.7, which has CPython gh-112275 (a process forked while another
# thread holds the runtime's lock hangs in the child; fixed for 3.11 by PR 112336, merged in September
# 2024). The template no longer forks from a threaded process (loader workers start from a fork server:
# train/parallel/data.py), but a user's code may, and the image can have the fix for free. Bump the minor with CI.

# One stage: the environment is installed in place. A build stage whose environment the runtime stage copies
# (COPY --from) writes the 6 GB twice; in place, a cold `make docker-build` took 127 s and 132 s of CPU against
# 238 s and 268 s, for the same image (wheels only: nothing is built from source, so nothing is left behind).
FROM python:3.11.14-slim-bookworm

# A numeric non-root user (the Kubernetes manifests run as 10001 too); a passwd entry, because
# getpass.getuser() (torch's compile caches) needs one. /runs: run directories and checkpoints.
RUN groupadd --gid 10001 trainer \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin trainer \
    && install -d -o 10001 -g 10001 -m 0775 /runs

# Run-time system packages, nothing for building:
# - a C/C++ compiler: torch.compile needs one when it runs (Triton builds its C launcher helper on GPU,
#   inductor's CPU backend compiles C++); python:slim has the Python headers they include, but no compiler.
# - rdma-core's user space (libibverbs + the providers, mlx5 among them): without it NCCL cannot open
#   InfiniBand/RoCE devices and multi-node traffic silently falls back to TCP sockets.
# Versions: the base tag pins the Debian release; its point releases replace the package versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

# The virtual environment, from the requirement set CI installs and tests; no pip cache.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.txt requirements-hf.txt /tmp/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt -r /tmp/requirements-hf.txt \
    && rm /tmp/requirements.txt /tmp/requirements-hf.txt
WORKDIR /app
COPY train/ train/
COPY configs/ configs/
COPY examples/ examples/
# Your own task files (tasks/my_task.py, tasks/my.yaml): the one folder of yours the build context sends.
COPY tasks/ tasks/
RUN python -m compileall -q train \
    && ln -s /runs runs

# Labels and build arguments last: a new commit (REVISION) changes only these layers, so a rebuild
# reuses the system packages and the 6 GB environment from the cache instead of copying them again.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="ddp-template" \
      org.opencontainers.image.description="PyTorch DDP training: python -m train.launch (torchrun) as entrypoint" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.14-slim-bookworm"

# HOME and every cache on /tmp: the root filesystem may be read-only (Kubernetes, compose).
# NCCL: warnings only (no INFO/TRACE), and a failed or hung collective ends the process instead of
# hanging the job; nothing about the network or transports, which differ between clusters.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NCCL_DEBUG=WARN \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    GIT_COMMIT=${REVISION}

USER 10001:10001
# c10d rendezvous: 29400 (compose), 23456 (PyTorchJob's pytorchjob-port)
EXPOSE 29400 23456
ENTRYPOINT ["python", "-m", "train.launch"]
CMD ["--config", "configs/default.yaml"]
