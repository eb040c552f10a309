"""python -m train.reference [--check]: docs/reference.md, every configuration key.

Each key of train/config.py's dataclasses and of the built-in tasks' Configs, with its default, its meaning
(the comment on its line in the source) and what a relaunch of a run does with a changed value. Written
from the code, so it cannot drift: tests/processes/test_readme.py checks the page equals this output, and --check
exits 1 where it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path

from train import config, relaunch
from train.task_loader import load_class

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
TASKS = {"train.tasks.image:ImageClassification": "the built-in image task (configs/default.yaml)",
         "train.tasks.gpt:LanguageModel": "the built-in GPT (configs/gpt.yaml)",
         "train.tasks.hf:CausalLM": "a Hugging Face model (configs/hf.yaml)"}

# What a relaunch (the same run directory, resume=auto) does with a changed value: train/relaunch.py's rule of the
# key (a task's keys: its `relaunch` table), which the launch applies.
NOT_CHANGES = {"resume": "where a launch starts: see docs/checkpoints.md", "run": "another run (its own folder)"}


def on_relaunch(key: str, task_class: type | None = None) -> str:
    if key.split(".")[0] in NOT_CHANGES:
        return NOT_CHANGES[key.split(".")[0]]
    rule, why = relaunch.rule(key, task_class)
    return relaunch.SAID[rule] + (f": {why}" if why else "")


def comments(cls: type) -> dict[str, str]:
    """{field: the comment on its line} of a dataclass's source."""
    out: dict[str, str] = {}
    source = inspect.getsource(cls)
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            code = lines[tok.start[0] - 1][:tok.start[1]].strip()
            name = code.split(":", 1)[0].strip()
            if name.isidentifier() and ":" in code:
                out[name] = tok.string.lstrip("#").strip()
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "" or value is None:
        return '""'
    return str(value)


def keys(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every key of a dataclass, nested ones flattened (checkpoint.async_ is
    checkpoint.async, as the YAML and command line spell it)."""
    hints, notes, out = typing.get_type_hints(cls), comments(cls), []
    for f in dataclasses.fields(cls):
        if f.name in ("task", "task_name", "task_class"):
            continue
        hint = hints[f.name]
        name = f.name.rstrip("_")
        if dataclasses.is_dataclass(hint):
            out += keys(hint, f"{prefix}{name}.")
            continue
        meaning = notes.get(f.name, "")
        if typing.get_origin(hint) is typing.Literal:
            choices = ", ".join(_show(c) for c in typing.get_args(hint))
            meaning = f"{meaning} ({choices})" if meaning else f"one of {choices}"
        out.append((f"{prefix}{name}", _show(_default(f)), meaning))
    return out


def page() -> str:
    rows = ["# Configuration reference", "",
            "Every key, generated from the code by `python -m train.reference` (do not edit by hand).",
            "Set a key in YAML (`train:` then `steps: 100`) or on the command line (`train.steps=100`).",
            "The last column says what a relaunch of the same run does with a changed value (train/relaunch.py).",
            "A change is applied, applied from the resumed step, or the new data from its beginning; the log names it.",
            "Or it is refused: one line, exit 2, nothing written; start a new run with another `run.name`.",
            "On a finished run, a change that would need training is refused: raise `train.steps`.", ""]

    def table(entries, task_class=None):
        rows.extend(["| key | default | meaning | on relaunch |", "| --- | --- | --- | --- |"])
        rows.extend(f"| `{k}` | `{d}` | {m.replace('|', '/')} | {on_relaunch(k, task_class)} |"
                    for k, d, m in entries)
        rows.append("")

    table(keys(config.Config))
    rows.extend(["A task's own keys follow the task's `relaunch` table (`Task.relaunch`, docs/tasks.md); a key it does "
                 "not list is refused. A key a run's record lacks (a run of an older release) compares as its "
                 "default.", ""])
    for spec, what in TASKS.items():
        cls = load_class(spec)
        rows.extend([f"## `task.*` of {what}", "", f"`task.name: {spec}`.", ""])
        table(keys(cls.Config, "task."), cls)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.reference", description=(
        "Print docs/reference.md: every configuration key, its default, its meaning and what a relaunch does "
        "with a changed value, written from the code."))
    p.add_argument("--check", action="store_true", help="exit 1 where docs/reference.md differs from it")
    args = p.parse_args(argv)
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            print(f"error: {PAGE} is out of date: run python -m train.reference > docs/reference.md",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
