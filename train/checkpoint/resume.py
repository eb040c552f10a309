"""Which checkpoint a start resumes from: the decision (`agree`: made once a launch, by all ranks together)
and its table of cases (RESUME_CASES), which the code logs from and the tests read. The checks that a
checkpoint fits this run (another model, optimizer or config: `state_mismatch`, `config_diff`) are here too;
the loading itself, with its fall back past corrupt checkpoints, is Checkpointer.resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from train.checkpoint import memory
from train.checkpoint.storage import (
    MANIFEST,
    NAME,
    OLD_NAME,
    complete_checkpoints,
    convert_hint,
    inside,
    old_checkpoints,
    read_manifest,
)
from train.config import Config, to_dict
from train.errors import ConfigError, missing_path

# What a start does with the checkpoints it finds: every case, once. `agree` picks the case and its candidates
# (the case's words are its log line), Checkpointer.resume tries them; check_fresh_start guards resume=never.
# Each case names the tests that show it (tests/quick/test_resume.py::test_the_resume_table_names_real_tests keeps
# them real): a case is added here with its test.
RESUME_CASES = {
    "auto, no checkpoint": (
        "a fresh run from step 0",
        ["processes/test_resume.py::test_sigterm_to_torchrun_mid_epoch_then_resume_is_bitwise_exact"]),
    "auto, the run's own checkpoints": (
        "the newest complete one (not newer than `latest`), bitwise as an uninterrupted run",
        ["processes/test_resume.py::test_sigterm_to_torchrun_mid_epoch_then_resume_is_bitwise_exact",
         "processes/test_resume.py::test_relaunching_a_finished_run_changes_nothing"]),
    "auto, step folders without a manifest": (
        "tried in their turn as corrupt ones: a copy that lost its manifest.json is set aside (kept, never "
        "overwritten or deleted) once an older one loads, and refused (exit 2) with every folder kept if none does",
        ["processes/test_resume.py::test_step_folders_without_a_manifest_are_never_overwritten_or_deleted"]),
    "auto, a finished run whose checkpoints are gone": (
        "refused (exit 2): its summary.json says it ran, and starting over would redo it and overwrite its record",
        ["processes/test_resume.py::test_a_finished_run_whose_checkpoints_were_deleted_is_not_trained_again"]),
    "auto, the newest corrupt (any rank's share)": (
        "one warning each, all ranks fall back to the newest that loads; the newer ones are set aside",
        ["processes/test_resume.py::test_corrupt_latest_falls_back_to_the_previous",
         "processes/test_checkpoint_format.py::test_a_flipped_byte_in_rank_1s_shard_falls_back_in_one_line_on_every_rank",
         "processes/test_resume.py::test_a_checkpoint_that_passes_its_crc_but_does_not_load_is_skipped_and_never_executed"]),
    "auto, none loads": (
        "refused (exit 2) with the newest one's problem and the ways out; every checkpoint stays, nothing trained",
        ["processes/test_resume.py::test_a_run_none_of_whose_checkpoints_loads_is_refused_in_one_line_and_they_stay"]),
    "another model or optimizer": (
        "refused (exit 2), nothing written: a relaunch by its key's rule (train/relaunch.py), a new run from PATH "
        "naming the config keys and tensors that differ",
        ["processes/test_resume.py::test_a_run_none_of_whose_checkpoints_loads_is_refused_in_one_line_and_they_stay",
         "processes/test_relaunch.py::test_a_relaunch_refused_by_the_trainer_writes_nothing"]),
    "another world size or strategy (DDP, FSDP, HSDP)": (
        "DCP reshards on load; the same samples seen, with a warning that it is no longer bitwise",
        ["processes/test_checkpoint_format.py::test_world_size_2_then_1_then_3_ends_with_the_samples_and_weights_of_an_"
         "uninterrupted_run", "processes/test_fsdp.py::test_a_run_changes_strategy_at_each_stop_ddp_to_fsdp_and_back",
         "processes/test_hsdp.py::test_a_stop_and_relaunch_under_hsdp_is_bitwise_and_checkpoints_cross_to_ddp_on_2_ranks"
         "_and_back"]),
    "another seed": (
        "a relaunch of the run is refused (exit 2); a new run from resume=PATH takes its own, with a warning",
        ["processes/test_data.py::test_a_relaunch_with_another_seed_is_refused_and_changes_nothing",
         "processes/test_resume.py::test_resume_from_a_path"]),
    "an earlier format (one .pt file)": (
        "refused (exit 2) with the `python -m train.checkpoint --convert` command, which converts it",
        ["processes/test_checkpoint_format.py::test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line_until_converted",
         "processes/test_compat.py::test_a_checkpoint_of_42fd791_converts_and_resumes_bitwise"]),
    "the previous release's checkpoint": (
        "resumes bitwise as an uninterrupted run of this release",
        ["processes/test_compat.py::test_the_previous_releases_checkpoint_resumes_bitwise"]),
    "PATH, the run directory holds none of its own": (
        "a new run (a branch, a fine-tune) from PATH; refused (exit 2) if nothing there loads",
        ["processes/test_resume.py::test_resume_from_a_path",
         "processes/test_resume.py::test_a_checkpoint_that_passes_its_crc_but_does_not_load_is_skipped_and_never_executed"]),
    "PATH, the run directory holds its own": (
        "a relaunch: continues from its own as auto does, PATH last",
        ["processes/test_resume.py::test_a_relaunched_branch_continues_from_its_own_checkpoints_not_from_resume_path"]),
    "PATH inside the run directory": (
        "a rollback, once: the later checkpoints are set aside, the saves after it record it",
        ["processes/test_resume.py::test_resuming_before_newer_checkpoints_sets_them_aside_and_keeps_the_new_saves"]),
    "a memory state newer than the disk's": (
        "every rank loads its share from host memory (checkpoint.memory_every; a node that lost it is sent a peer's "
        "copy), bitwise as from disk; the disk's checkpoints are tried next if it does not load",
        ["processes/test_memory.py::test_a_killed_worker_resumes_from_host_memory_bitwise_and_loses_at_most_"
         "memory_every_steps",
         "systems/test_memory_hosts.py::test_a_host_lost_with_its_memory_and_replaced_resumes_from_the_peers_copy_"
         "bitwise"]),
    "an incomplete memory state": (
        "a newer state some share of which no node holds (a copy cut short, a host lost without a peer's copy) is "
        "removed; the newest complete state, in memory or on disk, loads",
        ["processes/test_memory.py::test_an_incomplete_memory_state_is_passed_over_for_the_disk"]),
    "PATH inside the run directory, newer states in host memory": (
        "the rollback as without them: they are removed, never loaded",
        ["processes/test_memory.py::test_a_rollback_ignores_and_removes_newer_states_in_host_memory"]),
    "never": (
        "a fresh run from step 0; refused (exit 2) where the run directory holds a run: nothing is overwritten",
        ["processes/test_stops.py::test_resume_never_on_an_earlier_run_refuses_in_one_line_and_changes_nothing"]),
}


@dataclass
class Decision:
    case: str  # a key of RESUME_CASES
    candidates: list  # the checkpoints to try, best first: folders (Path) and states in host memory (MemoryState)
    rollback: str | None = None  # resume=PATH inside the run directory: PATH relative to it (every save records it)
    memory_id: str | None = None  # which run the states in host memory are of (memory.memory_id)

    def line(self, resume: str) -> str:
        return f"resume={resume}: {self.case}: {RESUME_CASES[self.case][0]}"


def agree(cfg: Config, rank: int, world_size: int, per_node: int = 1) -> Decision:
    """The launch's one resume decision, the same on every rank, made before anything is built: what the build
    leaves uninitialized (a resume overwrites it) and what Checkpointer.resume tries follow from it alone; and
    the run's memory id (memory.memory_id).

    The candidates come from two sources: the run's checkpoint folder, listed by rank 0 (a folder every node
    shares, where a node with a stale listing must not pick another step), and the states in host memory that
    each node holds (checkpoint.memory_every), listed by every rank and gathered. A usage error (ConfigError) is
    raised on every rank. Which candidate loads is agreed later, candidate by candidate, over every rank's share."""
    found: list = [None, None, None]  # the decision, or the error that refuses the start; the memory id
    if rank == 0:
        try:
            found[0] = decide(cfg)
            found[2] = memory.memory_id(cfg, create=False)
        except ConfigError as e:
            found[1] = str(e)
    if world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[1] is not None:
        raise ConfigError(found[1])
    decision, run_id = found[0], found[2]
    layout = memory.Layout.of(cfg, world_size, per_node)
    held = memory.listing(cfg, run_id, layout, rank)
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, held)
        held = sorted({x for rank_held in everyone for x in rank_held})
    decision = with_memory(decision, held, layout)
    decision.memory_id = run_id
    return decision


def with_memory(decision: Decision, held: list[tuple[int, int, int]], layout: memory.Layout) -> Decision:
    """The disk's decision, with the newest complete state in host memory first where it is newer than the run's
    own checkpoints. A rollback and a fresh start (resume=never) load none."""
    complete, incomplete = memory.complete_steps(held, layout)
    if not held or decision.case == "never":
        return decision
    if decision.case == "PATH inside the run directory":
        return Decision("PATH inside the run directory, newer states in host memory", decision.candidates,
                        decision.rollback)
    own = [c for c in decision.candidates if decision.case != "PATH, the run directory holds none of its own"
           and NAME.match(c.name) and (c / MANIFEST).exists()]
    newest = max((int(NAME.match(c.name).group(1)) for c in own), default=-1)
    if complete is not None and complete.step > newest:
        return Decision("a memory state newer than the disk's", [complete, *decision.candidates], decision.rollback)
    if incomplete is not None and incomplete > newest:
        return Decision("an incomplete memory state", decision.candidates, decision.rollback)
    return decision


def decide(cfg: Config) -> Decision:
    """The resume decision over this process's listing of the run directory (`agree` shares rank 0's).
    resume=PATH is where a new run starts; once this run directory holds complete checkpoints of its own, the same
    command line relaunched (a requeue, a torchrun or pod restart) continues from them as resume=auto does, PATH
    last. A PATH inside this run directory rolls the run back to it, once: the saves after the rollback carry PATH
    in their manifest, and a relaunch continues from those. A usage error is a ConfigError."""
    folder = cfg.run_dir / "checkpoints"
    if cfg.resume == "never":  # check_fresh_start refused a run directory that holds a run
        return Decision("never", [])
    own = complete_checkpoints(folder)
    if not own and (old := old_checkpoints(folder)):
        raise ConfigError(f"{old[0]} is a checkpoint of an earlier version of this project (one .pt file): "
                          f"{convert_hint(folder)}")
    # step folders without a manifest: no save of this project wrote them (a save renames into place)
    if cfg.resume == "auto" and (unfinished := _unfinished(folder)):
        return Decision("auto, step folders without a manifest", sorted(own + unfinished, reverse=True))
    if cfg.resume == "auto":
        if not own:
            _refuse_a_finished_run(cfg)
        return Decision("auto, the run's own checkpoints" if own else "auto, no checkpoint", own)
    p = Path(cfg.resume)
    rollback = None
    if inside(p, cfg.run_dir) and p.resolve() not in (cfg.run_dir.resolve(), folder.resolve()):
        rollback = str(p.resolve().relative_to(cfg.run_dir.resolve()))
    try:
        targets = _targets(p)
    except ConfigError:
        if not own:
            raise
        targets = []  # PATH is gone, but this run no longer needs it
    if own and (rollback is None or any(read_manifest(c).get("rollback") == rollback for c in own)):
        return Decision("PATH, the run directory holds its own", own + [t for t in targets if t not in own], rollback)
    if rollback is not None:
        return Decision("PATH inside the run directory", targets, rollback)
    _refuse_a_finished_run(cfg)
    return Decision("PATH, the run directory holds none of its own", targets)


def _unfinished(folder: Path) -> list[Path]:
    """Checkpoint folders without their manifest, which every save of this project writes before the folder gets
    its name: a copy or an edit by hand. They count as checkpoints that do not load, never as free names."""
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if NAME.match(p.name) and p.is_dir() and not (p / MANIFEST).exists()]


def _refuse_a_finished_run(cfg: Config) -> None:
    """A start from step 0 (or from another run's checkpoint) where this run directory holds a finished run whose
    checkpoints are gone: the run would be trained again and its metrics and summary overwritten."""
    if (cfg.run_dir / "summary.json").is_file():
        raise ConfigError(f"{cfg.run_dir} holds a finished run (summary.json) but none of its checkpoints: starting "
                          f"again would train it again over its record. Choose a new run.name or run.dir, or put "
                          f"its checkpoints back in {cfg.run_dir / 'checkpoints'}")


def _targets(p: Path) -> list[Path]:
    """The checkpoints resume=PATH names, newest first: PATH itself, or those in PATH or PATH/checkpoints."""
    if not p.exists():
        raise missing_path("resume", p, "a checkpoint folder step_NNNNNNNN, or a run directory or checkpoints "
                                        "folder that holds them")
    for d in (p, p / "checkpoints"):
        if not complete_checkpoints(d) and old_checkpoints(d):
            raise ConfigError(f"resume: {p} holds checkpoints of an earlier version of this project (one .pt "
                              f"file each): {convert_hint(d)}")
    if OLD_NAME.match(p.name) and p.is_file():
        raise ConfigError(f"resume: {p} is a checkpoint of an earlier version of this project (one .pt file): "
                          f"{convert_hint(p.parent)}")
    if NAME.match(p.name) and p.is_dir():
        return [p]
    for d in (p, p / "checkpoints"):
        if d.is_dir() and (found := complete_checkpoints(d)):
            return found
    raise ConfigError(f"resume: {p} is neither a checkpoint folder nor a folder holding checkpoints")


# What a run writes at the top of its run directory, over anything of those names there
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "report.txt", "report.png")


def check_fresh_start(cfg: Config) -> None:
    """A run writes into a run directory of its own: never over a user's files of the names it writes (a folder
    that holds no run of this project: no run_info.json, which each start writes first, and no checkpoints);
    and resume=never starts afresh, which must not overwrite an earlier run's checkpoints and metrics."""
    d = cfg.run_dir
    if d.is_dir() and not (d / "run_info.json").exists() and not (d / "checkpoints").exists():
        if theirs := [n for n in RUN_FILES if (d / n).exists()]:
            raise ConfigError(f"run.dir {d} holds no run of this project but files a run writes ({', '.join(theirs)})"
                              f", which it would overwrite: choose another run.dir (a folder of its own)")
    if cfg.resume != "never":
        return
    found = [p.name for p in (cfg.run_dir / "checkpoints", cfg.run_dir / "metrics.jsonl", cfg.run_dir / "summary.json")
             if p.exists() and (p.is_file() or any(p.iterdir()))]
    if found:
        raise ConfigError(f"resume=never but {cfg.run_dir} already holds a run ({', '.join(found)}): choose a new "
                          f"run.name or run.dir for the fresh start, or resume=auto to continue it")


def state_mismatch(expected: dict, got: dict) -> str | None:
    """How two {name: shape} of a state differ (this run's, the checkpoint's); None when they do not."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {got[k]} vs {v}" for k, v in expected.items() if k in got and got[k] != v]
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ, first {shapes[0]} (checkpoint vs config)")
    if missing:
        problems.append(f"{len(missing)} missing, first {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, first {unexpected[0]}")
    return "; ".join(problems) or None


def config_diff(cfg: Config, state: dict, section: str) -> str:
    """How the checkpoint's keys of a config section (task, optim) differ from this run's, as ` (it has
    task.model=resnet18, this run task.model=resnet34)`; empty when they are the same or unknown."""
    theirs = (state.get("config") or {}).get(section)
    if not isinstance(theirs, dict):
        return ""
    ours = to_dict(cfg)[section]
    keys = [k for k in dict.fromkeys([*theirs, *ours]) if theirs.get(k) != ours.get(k)]
    if not keys:
        return ""
    return (" (it has " + ", ".join(f"{section}.{k}={theirs.get(k)}" for k in keys[:3])
            + ", this run " + ", ".join(f"{section}.{k}={ours.get(k)}" for k in keys[:3]) + ")")


def shapes(metadata: Metadata, part: str) -> dict:
    """{name: shape} of the tensors of one part ("model", "optimizer") of a checkpoint, by DCP's index."""
    paths = metadata.planner_data or {}
    return {".".join(paths.get(fqn, tuple(fqn.split(".")))[1:]): tuple(md.size)
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.split(".", 1)[0] == part and isinstance(md, TensorStorageMetadata)}


def shapes_of(tree: dict, prefix: str = "") -> dict:
    """{name: shape} of the tensors of a nested state dict, named as shapes names a checkpoint's."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= shapes_of(v, f"{prefix}{k}.")
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = tuple(v.shape)
    return out
