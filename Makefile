# Set-up and launch. Every target installs what it needs into .venv first.
#   make train-local            train configs/default.yaml on this machine (NPROC=, CONFIG=, ARGS=)
#   make test                   the whole test suite (PYTEST_ARGS=, TEST_WORKERS=)
#   make test-quick             the tests that start no process (tests/quick/), a minute or two
#   make test-pages             every command of README.md and docs/, as a reader meets them (tests/pages/)
#   make test-bench             the benchmarks and the GPU check's script at toy sizes on the CPU (tests/bench/)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
NPROC ?=
ARGS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 3

.PHONY: venv dev train-local test test-quick test-pages test-bench test-python venv-torch test-torch lint bench gpu-check clean-runs

# The marker files make re-runs instant; they are rebuilt when the pins change.
# Python 3.11 or newer: the pins (numpy 2.4, pillow 13, matplotlib 3.11) have no wheels for 3.10, whose
# support ended in October 2026.
$(VENV)/.deps: requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "error: $(PYTHON) is \
	not Python 3.11 or newer ($$($(PYTHON) --version 2>&1)): run with PYTHON=python3.11 (or 3.12, 3.13)" >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(TORCH),)
	$(PY) -m pip install -q -r requirements.txt
else
	PIP_CONFIG_FILE=/dev/null $(PY) -m pip install -q torch==$(TORCH) torchvision==$(TORCHVISION)
	$(PY) -m $(KEEP_TORCH_INSTALL)
endif
	@touch $@

# The development set-up adds the tests' tools and the optional Hugging Face extra (requirements-hf.txt: transformers,
# safetensors, tokenizers; peft for LoRA); with TORCH=, less requirements-dev.txt's `-r requirements.txt` (the pins).
DEV_REQUIREMENTS = $(if $(TORCH),<(grep -v '^-r requirements.txt' requirements-dev.txt),requirements-dev.txt)
$(VENV)/.dev: $(VENV)/.deps requirements-dev.txt requirements-hf.txt
	$(PY) -m pip install -q -r $(DEV_REQUIREMENTS) -r requirements-hf.txt
	@touch $@

venv: $(VENV)/.deps
dev: $(VENV)/.dev

train-local: venv
	$(PY) -m train.launch $(if $(NPROC),--nproc-per-node=$(NPROC)) -- --config $(CONFIG) $(ARGS)

# TEST_WORKERS test files at a time (pytest-xdist, --dist loadfile): a file's tests run in order on one
# worker, so the files that hold one resource (SLURM's cluster, the Docker engine) never share it, while
# the tests that wait on deadlines overlap the ones that compute: three on CI's two cores keep both busy.
# tests/conftest.py orders the files. The project's bytecode is written first: the suite starts hundreds of
# processes, and where PYTHONDONTWRITEBYTECODE is set (CI's environment may set it) each would compile train/ anew.
test: dev
	$(PY) -m compileall -q train tests >/dev/null
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=tests/pages --ignore=tests/bench $(PYTEST_ARGS)

# Every command of README.md and docs/, in a reader's order, on one copy of the project (tests/pages/, minutes).
test-pages: dev
	$(PY) -m pytest tests/pages -q $(PYTEST_ARGS)

# The measuring tools: every benchmark of bench/ and `make gpu-check` at toy sizes (tests/bench/, minutes): they
# guard the scripts that measure the template, not the template, so make test leaves them to this tier.
test-bench: dev
	$(PY) -m pytest tests/bench -q $(PYTEST_ARGS)

# The quick tier: tests/quick/ starts no process (its conftest.py refuses one), so it needs one core and no
# worker; the other tiers are tests/processes/ (training processes) and tests/systems/ (SLURM, Docker, real hosts).
test-quick: dev
	$(PY) -m pytest tests/quick -q $(PYTEST_ARGS)

# The checkpoint and resume tests under another Python docs/dev/testing.md names (CI: 3.13; a checkpoint's pickled
# classes move between versions), in a venv of its own: make test-python OTHER_PYTHON=/path/to/python3.13
OTHER_PYTHON ?= python3.13
OTHER_TESTS ?= tests/quick/test_checkpoint_format.py tests/quick/test_resume.py tests/processes/test_resume.py \
	tests/processes/test_checkpoint_format.py
test-python:
	$(MAKE) test PYTHON=$(OTHER_PYTHON) VENV=.venv-$(notdir $(OTHER_PYTHON)) PYTEST_ARGS="$(OTHER_TESTS)"

# A chosen set of tests under another torch of the supported range (README; CI: its two ends, 2.11.0 and 2.15.0),
# in a venv of its own (.venv-torch2.11.0) installed as a cluster's image would be: that torch and its torchvision
# first, then the README's install that keeps them (KEEP_TORCH_INSTALL). The launcher, a sync save and three
# async ones in a row, a resume, FSDP2, the HF reader and writer, a stop and its budget.
#   make test-torch TORCH=2.11.0 [TORCHVISION=0.26.0] [OTHER_PYTHON=python3.13]
TORCH ?=
TORCHVISION_2.11.0 := 0.26.0
TORCHVISION_2.15.0 := 0.29.2
TORCHVISION ?= $(TORCHVISION_$(TORCH))
# (The torch's own install reads no pip configuration file: a machine's cap on torch, such as one in
# /etc/xdg/pip/pip.conf, does not hold back the torch asked for.)
KEEP_TORCH_INSTALL = pip install -q -r <(grep -vE '^(torch|torchvision)==' requirements.txt)
TORCH_TESTS ?= tests/processes/test_torch_range.py::test_a_stop_slower_than_torchruns_own_timeout_completes_within_the_launchers_budget \
	tests/processes/test_launcher.py::test_a_hang_up_to_the_whole_process_group_checkpoints_and_exits_75 \
	tests/processes/test_launcher.py::test_torchrun_s_standbys_end_when_its_process_is_killed \
	tests/processes/test_launcher.py::test_a_standby_whose_imports_are_not_done_when_its_round_comes_starts_afresh_where_priorities_cannot_rise \
	tests/processes/test_launcher.py::test_a_stop_during_the_start_up_of_torchrun_s_second_round_is_exit_75 \
	tests/processes/test_resume.py::test_async_save_gives_the_same_checkpoints_as_a_synchronous_one \
	"tests/processes/test_resume.py::test_a_save_on_a_full_disk_is_one_line_and_the_checkpoints_before_it_resume[async]" \
	tests/processes/test_fsdp.py::test_a_resnet_under_fsdp_ends_bitwise_where_ddp_does \
	tests/processes/test_pretrained.py::test_fine_tuned_from_gpt2_under_fsdp_resumed_bitwise_then_exported_to_transformers \
	tests/quick/test_pack.py::test_a_conversations_logits_in_a_packed_window_are_its_logits_alone_gpt \
	tests/quick/test_pack.py::test_a_conversations_logits_in_a_packed_window_are_its_logits_alone_hf
# venv-torch: that venv alone (.ci/run installs both while the whole suite runs)
venv-torch test-torch:
	@test -n "$(TORCH)" -a -n "$(TORCHVISION)" || { echo "error: name the torch (and, for one other than \
	2.11.0 and 2.15.0, its torchvision): make $@ TORCH=2.11.0, or TORCH=X TORCHVISION=Y" >&2; exit 2; }
	$(MAKE) $(if $(filter venv-torch,$@),dev,test) PYTHON=$(OTHER_PYTHON) VENV=.venv-torch$(TORCH) TORCH=$(TORCH) \
		TORCHVISION=$(TORCHVISION) PYTEST_ARGS='$(TORCH_TESTS)'

lint: dev
	$(VENV)/bin/ruff check train tests bench examples

# Benchmarks (minutes; figures, not pass/fail): BENCHMARKS.md and BENCHMARKS.png.
# bench/suite/ (python -m bench all). GPU figures: measured here on a GPU; or GPU_JSON=file, written on one by
# `python -m bench.suite.gpu --json file` or `make gpu-check`; else the newest make gpu-check JSON in docs/dev/gpu/.
GPU_JSON ?=
bench: dev
	$(PY) -m bench all $(if $(GPU_JSON),--gpu-json $(GPU_JSON))

# One prepared check of a GPU machine, minutes (bench/check/gpu.py: an acceptance check, not a benchmark): its
# stages in order of value, each writing OUT/gpu_check.json as it ends. It installs nothing: the machine's own
# python and torch run it (.venv's if there is one). SMOKE=1: the same stages at toy sizes on the CPU.
# `make bench GPU_JSON=OUT/gpu_check.json` shows it.
# BUDGET: seconds after which no stage starts (a stage running then is cut), so a run stays within it.
OUT ?= gpu-check
SMOKE ?=
BUDGET ?= 300
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) -m bench gpu-check $(OUT) --budget-s $(if $(SMOKE),3000,$(BUDGET)) $(if $(SMOKE),--smoke)

clean-runs:
	rm -rf runs

# Containers (see docs/containers.md and docs/kubernetes.md; tests/systems/test_image.py, test_container.py and test_compose.py
# build and run them).
#   make docker-build           build the image $(IMAGE), the tag docker-compose.yml and k8s/ use
#   make compose-up             a 2-node job on this host (PROFILE=gpu: one GPU per node; PROFILE=cpu)
#   make compose-down           remove its containers (the runs volume with the checkpoints stays)
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ddp-template:$(IMAGE_VERSION)
PROFILE ?= gpu
# Compose v2 (the docker CLI plugin) where it is installed, else v1 (docker-compose, Debian 12's package)
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
COMPOSE_PROJECT ?= ddp-template

.PHONY: docker-build docker-context-check compose-up compose-down

# The build context is an allow-list (.dockerignore): a config in configs/ or tasks/ whose task.name is a file
# outside train/, configs/, examples/ and tasks/ (my_task.py at the root) would build an image that cannot
# import its task. Refused here, in one line; an absolute path is a mount's (a ConfigMap, docker run -v).
docker-context-check:
	@for f in configs/*.yaml tasks/*.yaml; do \
		[ -f "$$f" ] || continue; \
		for py in $$(sed -n 's/^[[:space:]]*name:[[:space:]]*["'"'"']\{0,1\}\([^"'"'"'[:space:]#]*\.py\):.*/\1/p' "$$f"); do \
			case "$$py" in \
				/*) ;; \
				train/*|configs/*|examples/*|tasks/*) [ -f "$$py" ] || { echo "error: $$f: task.name names $$py, which does not exist" >&2; exit 2; } ;; \
				*) echo "error: $$f: task.name names $$py, which the image leaves out (.dockerignore is an allow-list): move it to tasks/ and name it tasks/$${py##*/}" >&2; exit 2 ;; \
			esac; \
		done; \
	done

docker-build: docker-context-check
	docker build -t $(IMAGE) --build-arg VERSION=$(IMAGE_VERSION) \
		--build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) \
		--build-arg SOURCE=$$(git config --get remote.origin.url | sed -E 's#//[^/@]*@#//#' | grep . || echo unknown) .

compose-up: docker-build
	IMAGE=$(IMAGE) $(COMPOSE) -p $(COMPOSE_PROJECT) --profile $(PROFILE) up

compose-down:
	IMAGE=$(IMAGE) $(COMPOSE) -p $(COMPOSE_PROJECT) --profile gpu --profile cpu down

# SLURM on this machine (root; needs: apt-get install slurmctld slurmd slurm-client munge): a real
# 2-node cluster (n1, n2 on 127.0.0.1) to try slurm/train.sbatch. See "A cluster on this machine" in docs/slurm.md.
#   make slurm-local-up         start munge, slurmctld and one slurmd per node (NODES=2)
#   make slurm-local-down       stop what slurm-local-up started
NODES ?= 2

.PHONY: slurm-local-up slurm-local-down

slurm-local-up:
	NODES=$(NODES) bash slurm/local-cluster.sh up

slurm-local-down:
	bash slurm/local-cluster.sh down
