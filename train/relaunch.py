"""What a relaunch does with each changed key: one rule a key, the one docs/reference.md states.

A relaunch is a start in a run directory whose run has checkpoints to resume from. Its config is compared with
the run's record: the run's config.yaml before anything is queued (`python -m train --check`, the launcher,
`train.submit`: `check_record`), the resumed checkpoint's config once the trainer has read it. A key the record
lacks (a run of an older release) compares as its default, or as the task's `legacy` value where the task's key
did otherwise before it existed (task.pack). The rules:
- applied: takes effect at once and changes nothing already trained (logging, workers, checkpoints, sharding);
- training: applied from the resumed step (the optimizer's settings, the schedule, precision); a finished run,
  with no step left to apply it to, is refused;
- data: the new data, from its beginning (the position in the old data means nothing in the new); a finished run
  is refused. A new run from another run's checkpoint (resume=PATH) with other data starts at its beginning too;
- refused: another run (another task, model, optimizer or seed): one line, exit 2, nothing written.
A task's own keys follow the task's `relaunch` table (Task.relaunch); a key it does not list is refused.
How the parameters train (Task.param_groups, requires_grad) is the task's code, not a key: a resume compares the
checkpoint's optimizer groups with this launch's (`group_changes`), and a change is "training": each parameter
keeps its optimizer state, one frozen when the checkpoint was saved starts afresh.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from train.checkpoint.storage import NAME, complete_checkpoints
from train.config import Config, ConfigError, to_dict

APPLIED, TRAINING, DATA, REFUSED = "applied", "training", "data", "refused"
RULES = (APPLIED, TRAINING, DATA, REFUSED)
SAID = {APPLIED: "applied", TRAINING: "applied from the resumed step", DATA: "the new data from its beginning",
        REFUSED: "refused"}

# By key or section, the longest match first; any other key of train/config.py is applied. (run.* names the run
# and resume where it starts: they are no change of a run.)
BY_KEY = {
    "seed": (REFUSED, "it orders the rest of the epoch"),
    "optim.name": (REFUSED, "the checkpoint's optimizer state does not fit another optimizer"),
    "optim": (TRAINING, "the learning rate from the resumed step is logged"),
    "train.steps": (TRAINING, "the schedule ends there; more steps continue a finished run"),
    "train.global_batch_size": (TRAINING, "the steps after the resumed one take batches of the new size"),
    "train.precision": (TRAINING, ""),
    "train.grad_clip": (TRAINING, ""),
    "task.name": (REFUSED, "another task"),
    "dist.strategy": (APPLIED, "the checkpoint is resharded as it loads"),
    "dist.shard_size": (APPLIED, "the checkpoint is resharded as it loads"),
}
NOT_COMPARED = ("run.", "resume")


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    rule: str  # one of RULES
    why: str = ""

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def rule(key: str, task_class: type | None = None) -> tuple[str, str]:
    """(rule, why) of a dotted key; a task's key by its task's `relaunch` table, refused where it has none."""
    if key.startswith("task.") and key != "task.name":
        table = getattr(task_class, "relaunch", None) or {}
        name = key[len("task."):]
        if name in table:
            given = table[name]
            if given not in RULES:
                raise ConfigError(f"task {task_class.__name__}: relaunch[{name!r}] is {given!r}, not one of "
                                  f"{', '.join(RULES)}")
            return given, ""
        return REFUSED, "the task does not say what a change of it does (Task.relaunch)"
    while key:
        if key in BY_KEY:
            return BY_KEY[key]
        key = key.rpartition(".")[0]
    return APPLIED, ""


def _show(value) -> str:
    return '""' if value == "" else str(value).lower() if isinstance(value, bool) else str(value)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a, b) -> bool:
    """Equal as the record holds them (YAML or a checkpoint's dict): 1 and 1.0 are, a tuple and a list are."""
    return yaml.safe_load(yaml.safe_dump(a)) == yaml.safe_load(yaml.safe_dump(b))


def changes(record: dict, cfg: Config) -> list[Change]:
    """Every key whose value differs between the run's record (a config as to_dict writes it) and `cfg`, with its
    rule. A key the record lacks compares as its default (this release's), or as its task's `legacy` value; one only
    the record has is gone and is not compared."""
    new = _flat(to_dict(cfg))
    defaults = _flat(to_dict(dataclasses.replace(Config(), task_name=cfg.task_name, task_class=cfg.task_class,
                                                  task=cfg.task_class.Config() if cfg.task_class else None)))
    legacy = {f"task.{k}": v for k, v in (getattr(cfg.task_class, "legacy", None) or {}).items()}
    old = defaults | legacy | _flat(record)
    if (record.get("task") or {}).get("name", cfg.task_name) != cfg.task_name:  # another task: its keys are not ours
        old = {k: v for k, v in old.items() if not k.startswith("task.")} | {
            k: v for k, v in defaults.items() if k.startswith("task.")} | {"task.name": record["task"]["name"]}
    out = []
    for key, value in new.items():
        if key.startswith(NOT_COMPARED) or _same(old.get(key), value):
            continue
        out.append(Change(key, old.get(key), value, *rule(key, cfg.task_class)))
    return out


def group_changes(saved: list[dict], ours: list[dict]) -> list[Change]:
    """What a resume changes of how the parameters train: torch's param groups as the checkpoint holds them
    (`saved`, parameters by name; a group without "group" or "lr_scale" is a run of an older release: "default",
    1) against this launch's (`ours`). A parameter that moved (to another group, frozen, trained again) and a
    group's lr_scale or weight decay (a task's group's: the default group's is optim.weight_decay), each a Change
    of rule "training". A checkpoint with no groups recorded: none."""
    if not saved:
        return []
    then, now = _placed(saved), _placed(ours)
    out = []
    old, new = _settings(saved), _settings(ours)
    for name in (n for n in new if n in old):
        for i, key in enumerate(("lr_scale", "weight_decay")):
            if old[name][i] != new[name][i] and (key == "lr_scale" or name != "default"):
                out.append(Change(f"param_groups.{name}.{key}", old[name][i], new[name][i], TRAINING))
    moved: dict[tuple[str, str], list[str]] = {}
    for n in dict.fromkeys([*then, *now]):
        if (was := then.get(n, "frozen")) != (is_ := now.get(n, "frozen")):
            moved.setdefault((was, is_), []).append(n)
    for (was, is_), names in moved.items():
        more = ("" if len(names) == 1 else f" and {names[1]}" if len(names) == 2 else
                f" and {len(names) - 1} more")
        out.append(Change(f"parameter{'s' if len(names) > 1 else ''} {names[0]}{more}", was, is_, TRAINING))
    return out


def _placed(groups: list[dict]) -> dict[str, str]:
    """{parameter name: "group <name>"} of torch's param groups as a state dict names them."""
    return {n: f"group {g.get('group', 'default')}" for g in groups for n in g.get("params", [])}


def _settings(groups: list[dict]) -> dict[str, tuple[float, float]]:
    """{group name: (lr_scale, the weight decay of its matrices)}: of a group's one or two torch groups (matrices,
    vectors), the larger decay is its matrices'."""
    out: dict[str, tuple[float, float]] = {}
    for g in groups:
        name = g.get("group", "default")
        scale, decay = out.get(name, (g.get("lr_scale", 1.0), 0.0))
        out[name] = (scale, max(decay, g.get("weight_decay", 0.0)))
    return out


def refusal(found: list[Change], run_dir: Path, finished_at: int | None) -> str | None:
    """The one line of a relaunch refused, or None: a change that makes it another run, or, on a run finished at
    step `finished_at`, a change that would need training and finds no step left."""
    if refused := [c for c in found if c.rule == REFUSED]:
        c = refused[0]
        more = f" (and {', '.join(map(str, refused[1:]))})" if len(refused) > 1 else ""
        why = f": {c.why}" if c.why else ""
        return (f"relaunch of {run_dir} with {c}{more} refused{why}; start a new run with another run.name, or "
                f"relaunch with the run's own value ({c.key}={_show(c.old)})")
    if finished_at is not None:
        needs = [c for c in found if c.rule in (TRAINING, DATA) and c.key != "train.steps"]
        if needs:
            return (f"run {run_dir} is finished at step {finished_at}: {', '.join(map(str, needs))} would need "
                    f"training and no step is left; train more steps (train.steps above {finished_at}) or start a "
                    f"new run with another run.name")
    return None


def applied_line(found: list[Change], step: int) -> str | None:
    """The log line that names what a relaunch applies (the schedule's keys have schedule_change's line)."""
    said = [c for c in found if c.rule in (APPLIED, TRAINING) and not c.key.startswith("optim.")
            and c.key != "train.steps"]
    if not said:
        return None
    return f"relaunch with {', '.join(map(str, said))}: applied from step {step}"


def data_changed(found: list[Change]) -> list[Change]:
    return [c for c in found if c.rule == DATA]


def check_record(cfg: Config) -> None:
    """Before anything is queued or started: a relaunch of a run that has checkpoints, compared with its
    config.yaml; a refused change raises ConfigError (the trainer checks again against the checkpoint it loads)."""
    if cfg.resume == "never":
        return
    run_dir = cfg.run_dir
    own = complete_checkpoints(run_dir / "checkpoints")
    if not own:
        return  # nothing to resume: a fresh start (or a new run from resume=PATH) changes nothing trained
    try:
        record = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return  # no readable record: the trainer compares with the checkpoint's
    if not isinstance(record, dict):
        return
    last = int(NAME.match(own[0].name).group(1))
    if line := refusal(changes(record, cfg), run_dir, last if finished(run_dir, last, cfg) else None):
        raise ConfigError(line)


def finished(run_dir: Path, step: int, cfg: Config) -> bool:
    """Whether the run is finished at `step` (its summary.json says so) with no step left for `cfg`."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("steps") == step and step >= cfg.train.steps
