"""Every config and documented command at every world size, as dry runs in this process."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import ROOT, clean_env
from train import config
from train.config import ConfigError
from train.launch.command import check_training_args, check_world, parse_args, resolve, torchrun_command

CONFIGS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("examples/*.yaml")])


WORLDS = (1, 2, 3, 4, 8, 16, 32)


def dry_run(nnodes: int, nproc: int, train_args: list[str]) -> None:
    """What `python -m train.launch --dry-run --nnodes N --nproc-per-node P -- ARGS` checks (train/launch/launcher.py),
    without its signal handlers; raises the ConfigError it would print."""
    argv = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--dry-run", "--", *train_args]
    if nnodes > 1:
        argv.insert(0, "--rdzv-endpoint=127.0.0.1:29400")
    args, train_args = parse_args(argv)
    opts = resolve(args, clean_env())
    cfg = check_training_args(train_args, task=True)
    check_world(cfg, torchrun_command(opts, train_args))


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_launches_at_every_world_size_that_divides_its_global_batch(path):
    batch = config.load(path, [], task=False).train.global_batch_size
    for world in WORLDS:
        for nnodes, nproc in {(1, world), (max(1, world // 8), min(world, 8))}:  # one node, or nodes of 8
            if batch % world == 0:
                dry_run(nnodes, nproc, ["--config", path])
            else:
                with pytest.raises(ConfigError) as refused:
                    dry_run(nnodes, nproc, ["--config", path])
                line = str(refused.value)
                assert "\n" not in line and f"does not split evenly over {world} ranks" in line, line
                below = max(w for w in range(1, world) if batch % w == 0)
                assert f"run {below} " in line and f"train.global_batch_size={batch // world * world or world}" in line


def test_hsdp_groups_launch_at_every_world_size_they_divide_and_are_refused_in_one_line_elsewhere():
    """dist.strategy=hsdp at every world size, on one node or nodes of 8: the groups are a node's ranks by default
    (every world splits into them), or dist.shard_size ranks, refused in one line before torchrun starts where
    they do not divide the world (a global batch of 96 splits over every world size here)."""
    batch = ["--config", "configs/gpt.yaml", "train.global_batch_size=96", "dist.strategy=hsdp"]
    for world in WORLDS:
        for nnodes, nproc in {(1, world), (max(1, world // 8), min(world, 8))}:
            dry_run(nnodes, nproc, batch)  # groups of a node
            for size in (2, 3, 8, 16):
                if world % size == 0:
                    dry_run(nnodes, nproc, [*batch, f"dist.shard_size={size}"])
                    continue
                with pytest.raises(ConfigError) as refused:
                    dry_run(nnodes, nproc, [*batch, f"dist.shard_size={size}"])
                line = str(refused.value)
                assert "\n" not in line and line.startswith(f"dist.shard_size={size} does not divide the {world} ranks")
                fits = ", ".join(str(n) for n in range(1, world + 1) if world % n == 0)
                assert line.endswith(f"run a multiple of {size} ranks, or set dist.shard_size to one of {fits}"), line
    with pytest.raises(ConfigError, match="^dist.shard_size is an HSDP option: it has no meaning with "
                                          "dist.strategy=fsdp$"):
        dry_run(1, 4, [*batch, "dist.strategy=fsdp", "dist.shard_size=2"])
    with pytest.raises(ConfigError, match=r"^dist.shard_size must be >= 0 \(0: the ranks of a node\), got -1$"):
        dry_run(1, 4, [*batch, "dist.shard_size=-1"])


LAUNCHERS = ("train.launch", "torchrun", "sbatch", "train.submit", "make train-local")


def _sbatch_default(option: str) -> int | None:
    """An #SBATCH line's value in slurm/train.sbatch (the default of a plain `sbatch slurm/train.sbatch`)."""
    m = re.search(rf"^#SBATCH --{option}=(\d+)", (ROOT / "slurm" / "train.sbatch").read_text(), re.M)
    return int(m.group(1)) if m else None


def _option(words: list[str], *names: str) -> str | None:
    for i, w in enumerate(words):
        for name in names:
            if w == name and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(name + "="):
                return w.split("=", 1)[1]
    return None


def implied_worlds(command: str) -> tuple[list[int], str, list[str]]:
    """(the world sizes a documented command starts, its config, its train.* overrides). Where the command
    leaves the process count to the machine (make train-local's one per GPU), the GPU counts users have."""
    try:
        words = shlex.split(command.replace("\\\n", " "), comments=True)
    except ValueError:  # an inline span that quotes part of a command
        words = command.split("#")[0].split()
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    cfg = _option(words, "--config") or env.get("CONFIG") or "configs/default.yaml"
    if cfg in ("...", "X.yaml") or not (ROOT / cfg).is_file():
        cfg = "configs/default.yaml"
    overrides = [w for w in words if re.fullmatch(r"train\.\w+=\d+", w)]
    overrides += env.get("ARGS", "").split() if "ARGS" in env else []
    per_node = [1, 2, 4, 8]
    if "make train-local" in command:
        nodes = 1
        per_node = [int(env["NPROC"])] if "NPROC" in env else per_node
    elif "sbatch" in words:
        nodes = int(_option(words, "--nodes", "-N") or _sbatch_default("nodes") or 1)
        gpus = _option(words, "--gpus-per-node") or env.get("NPROC_PER_NODE") or _sbatch_default("gpus-per-node")
        per_node = [int(gpus)] if gpus and int(gpus) > 0 else per_node
    elif "train.submit" in command:
        nodes = int(_option(words, "--nodes") or 1)
        gpus = _option(words, "--nproc-per-node") or _option(words, "--gpus-per-node")
        per_node = [int(gpus)] if gpus and gpus.isdigit() and int(gpus) > 0 else per_node
    else:  # train.launch, torchrun
        nodes = int((_option(words, "--nnodes") or "1").split(":")[-1])
        nproc = _option(words, "--nproc-per-node", "--nproc_per_node")
        per_node = [int(nproc)] if nproc and nproc.isdigit() else per_node
    return [nodes * p for p in per_node], cfg, overrides


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, command) of every training command in the README's and the user pages' code."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
        for span in spans:
            for line in re.split(r"(?<!\\)\n", span):
                line = line.strip().lstrip("$ ")
                if any(k in line for k in LAUNCHERS) and "bench/" not in line and "--help" not in line:
                    found.append((page.name, line))
    return found


def test_each_training_command_the_docs_show_launches_at_the_world_size_it_implies():
    commands = documented_commands()
    assert len(commands) >= 20, commands  # the extraction still finds the docs' commands
    checked = set()
    for page, command in commands:
        worlds, cfg_path, overrides = implied_worlds(command)
        cfg = config.load(cfg_path, overrides, task=False)
        for world in worlds:
            checked.add(world)
            assert cfg.train.global_batch_size % world == 0, (
                f"{page}: `{command}` starts {world} ranks, which {cfg_path}'s global batch of "
                f"{cfg.train.global_batch_size} does not split over")
    assert {2, 8, 32} <= checked  # make train-local, 8-GPU nodes, docs/slurm.md's 4 nodes of 8


def test_micro_batches_are_the_fewest_and_as_even_as_can_be():
    for share in range(1, 70):
        for micro in (1, 3, 8, 32):
            cfg = config.load("configs/default.yaml", [f"train.global_batch_size={share * 4}",
                                                       f"train.micro_batch_size={micro}"], task=False)
            sizes = cfg.micro_batches(4)
            assert sum(sizes) == share and max(sizes) <= micro and len(sizes) == -(-share // micro)
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
