"""Every command of the user's pages, in the order a reader meets them: README.md, then docs/ in the order of the
README's table of pages, all on one scratch copy of the project, so that a command finds what the ones before it
made (the venv, a finished run, prepared shards). Each one runs as printed; or its dry run, where it needs GPUs or a
cluster; or is named with why it cannot run here (the network, a suite running itself). docs/commands.md tells
the reader which (`python -m tests.pages.test_pages > docs/commands.md` writes it from HOW).

Where a page tells the reader to do something in words (copy a file, download a model), the test does it as the
reader would (BEFORE): the model a reader downloads is a tiny random one with a tokenizer, made here."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, clean_env
from tests.quick.test_readme import shell_lines

README = ROOT / "README.md"

RUN = "runs as printed"
# The dry run: python -m train.launch --dry-run; pip install --dry-run; train.sbatch's DRY_RUN=1 in a job's environment.
DRY = "its dry run"
STAND_IN = "the network: the test writes a tiny random model with a tokenizer in that folder instead"
PLACEHOLDER = "a placeholder a reader fills in"
GPU = "GPUs"
DOCKER = "a Docker engine and the image: tests/systems/test_container.py and test_compose.py run them"
K8S = ("a Kubernetes cluster: tests/quick/test_k8s.py validates the manifests, tests/systems/test_k8s.py runs the "
       "pods' commands")
SUBMIT = "a SLURM cluster: tests/systems/test_slurm.py submits it to real daemons"
ROOT_APT = "root: tests/systems/test_slurm.py starts the same cluster"
BENCH = "minutes of CPU: tests/bench/test_bench.py runs it at toy sizes"

# How the tests run each command of the pages' shell blocks (a line, continuations joined, its comment cut). A page
# command missing here fails the test: a new command gets its test.
HOW: dict[str, str] = {
    # README.md
    "make train-local": RUN,
    "make test": "the test suite itself (CI runs it)",
    "pip install -r <(grep -vE '^(torch|torchvision)==' requirements.txt)": DRY,
    "python -m train.launch -- --config configs/default.yaml": RUN,
    "python -m train --config configs/default.yaml key.sub=value ...": PLACEHOLDER,
    "torchrun --nproc-per-node 2 -m train --config configs/default.yaml": RUN,
    "python -m train.launch --nproc-per-node 2 -- --config ...": PLACEHOLDER,
    "python -m train --config configs/default.yaml --check": RUN,
    "make train-local CONFIG=examples/regression.yaml": RUN,
    'make train-local CONFIG=examples/regression.yaml ARGS="run.name=regression-wide task.hidden=128 '
    'train.precision=bf16"': RUN,
    # docs/first-hour.md
    "git clone <this repository> && cd ddp-template": "the network (the test's copy is the clone)",
    "make venv": RUN,
    "source .venv/bin/activate": RUN,
    'make train-local ARGS="train.steps=100"': RUN,
    "python -m train --check --config tasks/my.yaml": RUN,
    "python -m train.launch --nproc-per-node 2 -- --config tasks/my.yaml": RUN,
    "sbatch --nodes=1 --gpus-per-node=2 --cpus-per-task=16 slurm/train.sbatch": DRY,
    # docs/fault-tolerance.md
    "python -m train.doctor --config configs/default.yaml": RUN,
    "python -m train.launch --doctor --nproc-per-node 8 -- --config ...": PLACEHOLDER,
    # docs/language-models.md
    "make train-local CONFIG=configs/gpt.yaml": RUN,
    # docs/pretrained.md
    "hf download HuggingFaceTB/SmolLM2-135M --local-dir models/my-model": STAND_IN,
    "python -m train.prepare corpus.txt data/my-text --tokenizer models/my-model": RUN,
    "for i in $(seq 100); do printf '{\"messages\": [{\"role\": \"user\", \"content\": \"What is %d + %d?\"}, "
    "{\"role\": \"assistant\", \"content\": \"%d.\"}]}\\n' $i $i $((i + i)); done > chats.jsonl": RUN,
    "python -m train.prepare chats.jsonl data/chats --tokenizer models/my-model --chat": RUN,
    'make train-local CONFIG=configs/hf.yaml ARGS="run.name=hf-chat task.path=models/my-model task.data=data/chats '
    'task.seq_len=64 train.global_batch_size=8 train.steps=20 train.precision=fp32"': RUN,
    "python -m train.launch --nproc-per-node 8 -- --config configs/hf.yaml task.path=models/my-model "
    "task.data=data/my-text": DRY,
    'make train-local CONFIG=configs/hf.yaml ARGS="task.path=models/my-model task.data=data/my-text '
    'train.precision=fp32 task.seq_len=256 train.global_batch_size=8 train.steps=20"': RUN,
    'make train-local CONFIG=configs/hf.yaml ARGS="run.name=hf-lora task.path=models/my-model task.data=data/my-text '
    'task.lora_rank=8 optim.lr=1e-3 train.precision=fp32 task.seq_len=256 train.global_batch_size=8 '
    'train.steps=20"': RUN,
    "python -m train.export runs/hf-lora --format hf": RUN,
    "python -m train.export runs/hf-lora --format hf --merged": RUN,
    "python -m train.export runs/hf --format hf --dtype bf16": RUN,
    "hf download openai-community/gpt2 --local-dir models/gpt2": STAND_IN,
    "python -m train.prepare corpus.txt data/gpt2-text --tokenizer models/gpt2": RUN,
    'make train-local CONFIG=configs/gpt.yaml ARGS="run.name=gpt2-ft task.init_from=models/gpt2 '
    'task.data=data/gpt2-text task.seq_len=1024"': RUN,
    "python -m train.export runs/gpt2-ft --format hf": RUN,
    # docs/observability.md
    "wandb sync runs/<name>/wandb/offline-run-*": "the network (W&B's servers)",
    "python -m train.report runs/<name>": RUN,
    # docs/containers.md
    "docker run --rm --gpus all --shm-size 8g --stop-timeout 120 -v ddp-runs:/runs ddp-template:0.1.0 "
    "--config configs/default.yaml train.steps=200": GPU,
    "docker run --rm --read-only --tmpfs /tmp:exec,mode=1777 --shm-size 1g -v ddp-runs:/runs ddp-template:0.1.0 "
    "--nproc-per-node 2 -- --config configs/default.yaml": DOCKER,
    "docker tag ddp-template:0.1.0 REGISTRY/ddp-template:0.1.0": "a registry",
    "docker push REGISTRY/ddp-template:0.1.0": "a registry",
    'docker run --rm --read-only --tmpfs /tmp:exec,mode=1777 --shm-size 1g -v ddp-runs:/runs -v '
    '"$PWD/tasks:/app/tasks:ro" ddp-template:0.1.0 --nproc-per-node 2 -- --config tasks/my.yaml': DOCKER,
    "docker build -t my-task:1 tasks": DOCKER,
    "docker run --rm --gpus all --shm-size 8g -v ddp-runs:/runs my-task:1": GPU,
    "docker compose -p ddp-template -f docker-compose.yml -f tasks/compose.yml --profile cpu up": DOCKER,
    "make compose-up": GPU,
    "make compose-up PROFILE=cpu": DOCKER,
    "make compose-down": DOCKER,
    "docker-compose -p ddp-template --profile cpu up": DOCKER,
    # docs/kubernetes.md
    "kubectl create secret generic wandb --from-literal=api-key=...": K8S,
    "kubectl apply -f k8s": K8S,
    "kubectl get pods -l training.kubeflow.org/job-name=ddp-template -o wide": K8S,
    "kubectl logs -f -l training.kubeflow.org/job-name=ddp-template --prefix --tail=-1 | grep '\\[rank 0\\]'": K8S,
    "kubectl logs -f -l training.kubeflow.org/job-name=ddp-template,training.kubeflow.org/replica-index=0": K8S,
    "kubectl delete -f k8s/pytorchjob.yaml": K8S,
    "kubectl apply -f k8s/2x8gpu": K8S,
    "kubectl apply -f k8s/trainjob": K8S,
    "kubectl get pods -l jobset.sigs.k8s.io/jobset-name=ddp-template -o wide": K8S,
    "kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=ddp-template --prefix --tail=-1 | grep '\\[rank 0\\]'": K8S,
    "kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=ddp-template,batch.kubernetes.io/job-completion-index=0": K8S,
    "kubectl delete -f k8s/trainjob/trainjob.yaml": K8S,
    "kubectl create configmap ddp-template-config --from-file=train.yaml=tasks/my.yaml --from-file=tasks/my_task.py "
    "--dry-run=client -o yaml > k8s/configmap.yaml": K8S,
    # docs/slurm.md
    "sbatch slurm/train.sbatch": DRY,
    "sbatch --nodes=4 --gpus-per-node=8 --time=24:00:00 -p gpu slurm/train.sbatch train.steps=20000": DRY,
    "sbatch --gpus-per-node=0 --cpus-per-task=16 slurm/train.sbatch": DRY,
    "CONFIG=configs/other.yaml PYTHON=/path/to/venv/bin/python sbatch slurm/train.sbatch": PLACEHOLDER,
    "CONTAINER_RUNTIME=pyxis CONTAINER_IMAGE=registry#ddp-template:0.1.0 sbatch slurm/train.sbatch": DRY,
    "apptainer build ddp-template.sif docker-daemon://ddp-template:0.1.0": "Apptainer and the image",
    "CONTAINER_RUNTIME=apptainer CONTAINER_IMAGE=$PWD/ddp-template.sif sbatch slurm/train.sbatch": DRY,
    "python -m train.submit --nodes 2 --partition gpu -- --config configs/default.yaml train.steps=20000": SUBMIT,
    "python -m train.submit --nodes 1 --gpus-per-node 2 --cpus-per-task 16 -- --config configs/default.yaml": SUBMIT,
    "python -m train.submit --nodes 2 --gpus-per-node 0 --cpus-per-task 16 -- --config configs/default.yaml": SUBMIT,
    "python -m train.submit --nodes 2 --sbatch account=proj --sbatch qos=high --sbatch mem=0 -- --config "
    "configs/default.yaml": SUBMIT,
    "sudo apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge": ROOT_APT,
    "sudo make slurm-local-up": ROOT_APT,
    "NPROC_PER_NODE=1 sbatch --gpus-per-node=0 --cpus-per-task=2 slurm/train.sbatch train.steps=50 && squeue":
        ROOT_APT,
    "sudo make slurm-local-down": ROOT_APT,
    # docs/benchmarks.md
    "make bench": BENCH,
    ".venv/bin/python -m bench.suite.overhead": BENCH,
    ".venv/bin/python -m bench.suite.throughput": BENCH,
    ".venv/bin/python -m bench.suite.checkpoint": BENCH,
    ".venv/bin/python -m bench.suite.recovery": BENCH,
    ".venv/bin/python -m bench.suite.packing": BENCH,
    ".venv/bin/python -m bench.suite.gpu": GPU,
    "torchrun --nproc-per-node 8 -m bench.suite.gpu --lm": GPU,
    ".venv/bin/python -m bench.studies.image_loader": BENCH,
    ".venv/bin/python -m bench.studies.fsdp_memory": BENCH,
    ".venv/bin/python -m bench.suite.fsdp_run_memory": BENCH,
    "make bench GPU_JSON=gpu.json": GPU,
    ".venv/bin/python -m bench.studies.stress_finish --runs 40": BENCH,
    ".venv/bin/python -m bench.studies.loader_start": BENCH,
    ".venv/bin/python -m bench.studies.resume_init": BENCH,
    "make gpu-check OUT=gpu-check": GPU,
    "make gpu-check SMOKE=1 OUT=/tmp/check": "minutes of CPU: tests/bench/test_bench.py runs it",
    "make bench GPU_JSON=gpu-check/gpu_check.json": GPU,
    ".venv/bin/python -m bench all --gpu-only --gpu-json gpu-check/gpu_check.json": GPU,
    # docs/troubleshooting.md
    "python -m train.launch --doctor --nnodes 2 --rdzv-endpoint node1:29400 -- --config configs/default.yaml": DRY,
}

# Values for the placeholders of a command that runs.
FILL = {"<name>": "default"}


def pages() -> list[Path]:
    """README.md, then the pages of its table in its order."""
    table = README.read_text().split("| [docs/", 1)[1]
    names = re.findall(r"^\| \[docs/([\w-]+\.md)\]", "| [docs/" + table, re.M)
    return [README, *(ROOT / "docs" / n for n in dict.fromkeys(names))]


def page_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), c) for p in pages() for c in shell_lines(p.read_text())]


def commands_page() -> str:
    """docs/commands.md: each page's commands and what the tests do with each."""
    out = ["# The pages' commands, as the tests run them", "",
           "Every command of the user's pages runs in CI, in the order a reader meets it, on a copy of the project.",
           "Each runs as printed, or as its dry run where it needs GPUs or a cluster.",
           "The others are named here with what they need.",
           "The test is `tests/pages/test_pages.py`."]
    current = None
    for page, command in dict.fromkeys(page_commands()):
        if page != current:
            out += ["", f"## {page}", "", "| command | in the tests |", "| --- | --- |"]
            current = page
        out.append(f"| `{command.replace('|', chr(92) + '|')}` | {HOW.get(command, '(not in the test)')} |")
    return "\n".join(out) + "\n"


# ---- the reader's steps in words, done before a command -----------------------------------------------------------

def chat_bpe_model(folder: Path, kind: str) -> None:
    """What `hf download` would put there, tiny: a random model (Llama's architecture for models/my-model, GPT-2's for
    models/gpt2) and a byte-level BPE tokenizer with ChatML's chat template and its two special tokens."""
    from tests import hf_models

    hf_models.tiny_tokenizer(folder, vocab=300)
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = hf_models.CHATML_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if kind == "gpt2":
        hf_models.tiny_gpt2(folder, vocab=320, positions=1024)
    else:
        hf_models.tiny_llama(folder, vocab=320, positions=1024, tokenizer=False)


def corpus(scratch: Path) -> None:
    """The reader's own text: the tiny tokenizer's sentences, enough for the GPT-2 example's 32 windows of 1024."""
    from tests import hf_models

    (scratch / "corpus.txt").write_text(hf_models.TEXT * 2000)


def own_task(scratch: Path) -> None:
    """docs/first-hour.md, "Your own model and data": the example copied to tasks/, its config pointed at the copy."""
    (scratch / "tasks").mkdir(exist_ok=True)
    shutil.copy(scratch / "examples" / "regression.py", scratch / "tasks" / "my_task.py")
    config = (scratch / "examples" / "regression.yaml").read_text()
    config = re.sub(r"(?m)^(\s+name: )\S*regression\.py:Regression", r"\1tasks/my_task.py:Regression", config)
    config = re.sub(r"(?m)^(\s+name: )regression$", r"\1my", config)
    assert "tasks/my_task.py:Regression" in config and "name: my\n" in config, config
    (scratch / "tasks" / "my.yaml").write_text(config)


BEFORE = {
    "python -m train --check --config tasks/my.yaml": own_task,
    "hf download HuggingFaceTB/SmolLM2-135M --local-dir models/my-model":
        lambda s: chat_bpe_model(s / "models" / "my-model", "llama"),
    "hf download openai-community/gpt2 --local-dir models/gpt2":
        lambda s: chat_bpe_model(s / "models" / "gpt2", "gpt2"),
    "python -m train.prepare corpus.txt data/my-text --tokenizer models/my-model": corpus,
}


# ---- dry runs ------------------------------------------------------------------------------------------------------

def sbatch_dry_run(command: str, scratch: Path) -> tuple[list[str], dict]:
    """train.sbatch in the environment SLURM gives a job for the options of `command` (its #SBATCH defaults
    otherwise), with DRY_RUN=1: it prints the srun command. scontrol reads a minimal slurm.conf for the host names."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        k, _, v = words.pop(0).partition("=")
        env[k] = v.replace("$PWD", str(scratch))
    script = next(i for i, w in enumerate(words) if w.endswith("train.sbatch"))
    options = dict(w.lstrip("-").split("=", 1) for w in words[1:script] if w.startswith("--") and "=" in w)
    defaults = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", (scratch / words[script]).read_text(), re.M))
    nodes = int(options.get("nodes", defaults["nodes"]))
    conf = scratch / ".slurm-dry.conf"
    conf.write_text(f"ClusterName=dry\nSlurmctldHost=localhost\nNodeName=n[1-{nodes}] CPUs=2\n")
    env |= {"SLURM_CONF": str(conf), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "ddp-template",
            "SLURM_JOB_NODELIST": f"n[1-{nodes}]" if nodes > 1 else "n1", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_GPUS_PER_NODE": options.get("gpus-per-node", defaults["gpus-per-node"]),
            "SLURM_CPUS_PER_TASK": options.get("cpus-per-task", defaults["cpus-per-task"]),
            "SLURM_SUBMIT_DIR": str(scratch), "DRY_RUN": "1"}
    return ["bash", words[script], *words[script + 1:]], env


def dry_run(command: str, scratch: Path) -> tuple[list[str] | str, dict]:
    if " sbatch " in f" {command} ":
        return sbatch_dry_run(command, scratch)
    if command.startswith("pip install "):
        return command.replace("pip install ", "pip install --dry-run ", 1), {}
    assert command.startswith("python -m train.launch "), command
    return command.replace("python -m train.launch ", "python -m train.launch --dry-run ", 1), {}


# ---- what a page says the reader sees ------------------------------------------------------------------------------

def shapes_missing(shown: list[str], output: str) -> list[str]:
    """The lines of `shown` that `output` does not hold in their order, numbers aside (times, losses, rates)."""
    lines, missing = iter(output.splitlines()), []
    for line in shown:
        parts = re.split(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)", line)
        shape = "".join(r"[\d.e+-]+" if i % 2 else re.escape(p) for i, p in enumerate(parts))
        shape = shape.replace(re.escape(".venv/"), r"\S*\.venv/")  # torchrun's line names the venv by its full path
        if not any(re.search(shape, o) for o in lines):
            missing.append(line)
            lines = iter(output.splitlines())
    return missing


def first_job(proc: subprocess.CompletedProcess, scratch: Path) -> None:
    """README's promise (the accuracy, 2 ranks in sync) and docs/first-hour.md's console output, line by line: the
    launcher's and torchrun's command lines on stderr, the log on stdout."""
    summary = json.loads((scratch / "runs" / "default" / "summary.json").read_text())
    promised = float(re.search(r"evaluation accuracy near (0\.\d+)", " ".join(README.read_text().split())).group(1))
    assert abs(summary["eval_accuracy"] - promised) <= 0.03, summary  # other CPUs' kernels round otherwise
    assert summary["world_size"] == 2 and summary["ranks_in_sync"] is True, summary
    assert "pip install" not in proc.stdout  # the venv was reused, not rebuilt
    page = (ROOT / "docs" / "first-hour.md").read_text()
    shown = re.search(r"```\n(\.venv/bin/python -m train\.launch .*?)```", page, re.S).group(1).splitlines()
    assert not shapes_missing([s for s in shown if s.startswith("+ ")], proc.stderr)
    assert not shapes_missing([s for s in shown if not s.startswith("+ ")], proc.stdout)


def longer(proc: subprocess.CompletedProcess, scratch: Path) -> None:
    """docs/first-hour.md, "Train longer": the line the page shows, and the run at its new end."""
    page = (ROOT / "docs" / "first-hour.md").read_text().split("## Train longer", 1)[1]
    shown = re.findall(r"```\n(relaunch with .*?)\n```", page, re.S)
    assert shown and not shapes_missing(shown, proc.stdout + proc.stderr), proc.stdout[-2000:]
    assert json.loads((scratch / "runs" / "default" / "summary.json").read_text())["steps"] == 100


def complete(name: str):
    def check(proc: subprocess.CompletedProcess, scratch: Path) -> None:
        assert f"run runs/{name}: complete" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    return check


def exported(run: str):
    def check(proc: subprocess.CompletedProcess, scratch: Path) -> None:
        folders = list((scratch / "runs" / run / "export").glob("step_*-hf"))
        assert len(folders) == 1 and (folders[0] / "config.json").is_file(), folders
        assert list(folders[0].glob("*.safetensors")), list(folders[0].iterdir())
    return check


def adapters_trained(proc: subprocess.CompletedProcess, scratch: Path) -> None:
    """docs/pretrained.md's LoRA run: the log line it shows, and the run complete."""
    page = (ROOT / "docs" / "pretrained.md").read_text()
    shown = re.search(r"```\n(\[rank 0\] INFO model: .*? the rest frozen)\n```", page).group(1)
    assert not shapes_missing([shown], proc.stdout), proc.stdout[-2000:]
    complete("hf-lora")(proc, scratch)


def exported_as(folder: str, *files: str):
    def check(proc: subprocess.CompletedProcess, scratch: Path) -> None:
        found = sorted(p.name for p in (scratch / "runs" / "hf-lora" / "export" / folder).iterdir())
        assert set(files) <= set(found), found
    return check


def report(proc: subprocess.CompletedProcess, scratch: Path) -> None:
    assert (scratch / "runs" / "default" / "report.png").is_file(), proc.stdout[-2000:]


AFTER = {
    "make train-local": first_job,
    'make train-local ARGS="train.steps=100"': longer,
    "make train-local CONFIG=examples/regression.yaml": complete("regression"),
    "python -m train.launch --nproc-per-node 2 -- --config tasks/my.yaml": complete("my"),
    "make train-local CONFIG=configs/gpt.yaml": complete("gpt"),
    'make train-local CONFIG=configs/hf.yaml ARGS="run.name=hf-chat task.path=models/my-model task.data=data/chats '
    'task.seq_len=64 train.global_batch_size=8 train.steps=20 train.precision=fp32"': complete("hf-chat"),
    'make train-local CONFIG=configs/hf.yaml ARGS="run.name=hf-lora task.path=models/my-model task.data=data/my-text '
    'task.lora_rank=8 optim.lr=1e-3 train.precision=fp32 task.seq_len=256 train.global_batch_size=8 train.steps=20"':
        adapters_trained,
    "python -m train.export runs/hf-lora --format hf": exported_as("step_00000020-hf", "adapter_model.safetensors",
                                                                     "adapter_config.json"),
    "python -m train.export runs/hf-lora --format hf --merged": exported_as("step_00000020-hf-merged", "config.json",
                                                                              "model.safetensors", "tokenizer.json"),
    "python -m train.export runs/hf --format hf --dtype bf16": exported("hf"),
    "python -m train.export runs/gpt2-ft --format hf": exported("gpt2-ft"),
    "python -m train.report runs/<name>": report,
}


def scratch_copy(dest: Path) -> Path:
    """The project as a clone has it (tracked files and new ones not ignored), with this checkout's .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


def test_every_command_of_the_pages_runs_as_printed(tmp_path):
    """Each command of README.md and docs/, in the reader's order, on one copy of the project: it exits 0 (as
    printed, or its dry run), and what the page says the reader sees is there. A command the table does not know
    fails the test, and docs/commands.md is the table as the reader gets it."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        import pytest
        pytest.skip("needs the project's .venv (made by make test)")
    commands = page_commands()
    unknown = [f"{page}: {c}" for page, c in commands if c not in HOW]
    assert not unknown, "commands without a row in HOW (run, dry run, or why not):\n" + "\n".join(unknown)
    assert not set(HOW) - {c for _, c in commands}, f"rows of HOW no page shows: {set(HOW) - {c for _, c in commands}}"
    assert (ROOT / "docs" / "commands.md").read_text() == commands_page(), \
        "docs/commands.md is out of date: python -m tests.pages.test_pages > docs/commands.md"

    scratch = scratch_copy(tmp_path / "project")
    venv = str(scratch / ".venv" / "bin")
    env = clean_env(PATH=f"{venv}:{clean_env()['PATH']}", VIRTUAL_ENV=str(scratch / ".venv"))
    env.pop("OMP_NUM_THREADS")  # as a reader's shell has it
    ran = []
    for page, command in commands:
        how = HOW[command]
        if command in BEFORE:
            BEFORE[command](scratch)
        if how not in (RUN, DRY):
            continue
        line = command
        for placeholder, value in FILL.items():
            line = line.replace(placeholder, value)
        argv, extra = (line, {}) if how == RUN else dry_run(line, scratch)
        proc = subprocess.run(["bash", "-c", argv] if isinstance(argv, str) else argv, cwd=scratch, env=env | extra,
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{page}: `{command}` ({how}) exited {proc.returncode}\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if how == RUN and command in AFTER and command not in {c for _, c, _ in ran}:  # (again: a relaunch)
            AFTER[command](proc, scratch)
        ran.append((page, command, how))
    print("\n".join(f"{page}: {how}: {c}" for page, c, how in ran))
    assert len(ran) >= 25


if __name__ == "__main__":
    sys.stdout.write(commands_page())
