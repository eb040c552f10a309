"""A run's report: its curves in one PNG and a few lines of text, from its files.

Reads RUN_DIR/metrics.jsonl (and summary.json, config.yaml when present), so it works on any run: a
finished one, one still training, one that was stopped. Writes RUN_DIR/report.png (loss, evaluation
accuracy, learning rate and throughput against the step) and RUN_DIR/report.txt. Training calls write() on
rank 0 at the end; `python -m train.report RUN_DIR` (train/report.py) on any run directory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PANELS = ("loss", "eval accuracy", "learning rate", "throughput (samples/s)")


class ReportError(ValueError):
    """RUN_DIR is not a run directory, or holds no metrics yet."""


def load(run_dir: Path) -> tuple[list[dict], list[dict], dict | None, dict | None]:
    """Training records, evaluation records, summary.json and config.yaml (None when absent)."""
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    if not path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: not a run directory, or a run that never logged a step")
    train, evals = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed process
            continue
        if isinstance(rec, dict) and "loss" in rec:
            train.append(rec)
        elif isinstance(rec, dict) and any(k.startswith("eval_") for k in rec):
            evals.append(rec)
    if not train:
        raise ReportError(f"{path} holds no training steps yet")
    summary = _read_json(run_dir / "summary.json")
    config = None
    if (run_dir / "config.yaml").is_file():
        import yaml

        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text())
        except yaml.YAMLError:
            pass
    return train, evals, summary, config


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _median(records: list[dict], key: str) -> float | None:
    # The first window of each process holds its start-up: left out when there is more.
    values = [r[key] for r in records[1:] or records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def headline(evals: list[dict]) -> str:
    """The evaluation metric shown beside the loss: the task's first other one (accuracy, perplexity)."""
    keys = [k for k in evals[-1] if k.startswith("eval_") and k != "eval_loss"] or ["eval_loss"]
    return keys[0]


def _unit(train: list[dict]) -> str:
    units = [k[:-6] for k in train[-1] if k.endswith("_per_s") and k != "samples_per_s"]
    return units[0] if units else "samples"


def text(run_dir: Path, train: list[dict], evals: list[dict], summary: dict | None, config: dict | None) -> str:
    total = (config or {}).get("train", {}).get("steps")
    last = train[-1]
    if summary is not None:
        status = f"complete, {summary.get('steps', last['step'])} steps"
        if "world_size" in summary:
            status += f" on {summary['world_size']} rank(s)"
        if "wall_s" in summary:
            status += f" in {summary['wall_s']:.1f} s"
    else:
        status = f"incomplete (no summary.json: running, stopped or failed), last logged step {last['step']}"
        if total:
            status += f" of {total}"
    lines = [f"run {run_dir}: {status}"]
    loss = f"train loss {train[0]['loss']:.4f} (step {train[0]['step']}) -> {last['loss']:.4f} (step {last['step']})"
    if evals:
        key, last = headline(evals), evals[-1]
        shown = [k for k in dict.fromkeys(["eval_loss", key]) if k in last]
        loss += "; eval " + ", ".join(f"{k[5:].replace('_', ' ')} {last[k]:.4f}" for k in shown)
        if scored := [r for r in evals if "eval_loss" in r]:  # lower is better for every task's loss
            best = min(scored, key=lambda r: r["eval_loss"])
            loss += f" (best eval loss {best['eval_loss']:.4f} at step {best['step']})"
    lines.append(loss)
    unit = _unit(train)
    perf = [f"throughput {_median(train, unit + '_per_s'):.1f} {unit}/s",
            f"{_median(train, 'step_time_s'):.3f} s/step (medians over log steps)"]
    if (share := _median(train, "data_wait_share")) is not None:
        perf.append(f"data wait {share:.1%}")
    ratios = [r["straggler_ratio"] for r in train if "straggler_ratio" in r]
    if ratios and len(train[-1].get("samples_per_s_rank", ())) > 1:
        perf.append(f"slowest/fastest rank x{_median(train, 'straggler_ratio'):.2f} (worst x{max(ratios):.2f})")
    lines.append(", ".join(perf))
    gpu = []
    if mem := [r["peak_mem_gib"] for r in train if "peak_mem_gib" in r]:
        gpu.append(f"peak GPU memory {max(mem):.2f} GiB")
    if (mfu := _median(train, "mfu")) is not None:
        gpu.append(f"MFU {mfu:.1%}")
    if gpu:
        lines.append(", ".join(gpu))
    return "\n".join(lines) + "\n"


def plot(train: list[dict], evals: list[dict], path: Path, title: str) -> None:
    # The Figure API with the Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc, ax_lr, ax_speed = fig.subplots(2, 2, sharex=True).flat
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["loss"] for r in train], color="C0", label="train")
    if evals:
        if with_loss := [r for r in evals if "eval_loss" in r]:
            ax_loss.plot([r["step"] for r in with_loss], [r["eval_loss"] for r in with_loss], "o-", color="C1",
                         label="eval")
        key = headline(evals)
        ax_acc.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-", color="C0")
        if key == "eval_accuracy":
            ax_acc.set_ylim(0, 1)
    else:
        ax_acc.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ax_acc.transAxes)
    ax_loss.legend()
    ax_lr.plot(steps, [r["lr"] for r in train], color="C0")
    unit = _unit(train)
    ax_speed.plot(steps, [r[f"{unit}_per_s"] for r in train], color="C0", label="all ranks")
    ax_speed.set_ylabel(f"{unit}/s")
    if any("mfu" in r for r in train):
        twin = ax_speed.twinx()
        twin.plot([r["step"] for r in train if "mfu" in r], [100 * r["mfu"] for r in train if "mfu" in r],
                  color="C2", label="MFU")
        twin.set_ylabel("MFU (%)")
    panels = ("loss", headline(evals).replace("_", " ") if evals else PANELS[1], "learning rate",
              f"throughput ({unit}/s)")
    for ax, name in zip((ax_loss, ax_acc, ax_lr, ax_speed), panels, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
    ax_lr.set_xlabel("step")
    ax_speed.set_xlabel("step")
    ax_speed.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.savefig(path, metadata={"Title": title, "Description": "panels: " + ", ".join(panels)})


def write(run_dir: Path) -> tuple[Path, str]:
    """report.png and report.txt in run_dir; returns the PNG's path and the text."""
    run_dir = Path(run_dir)
    train, evals, summary, config = load(run_dir)
    report = text(run_dir, train, evals, summary, config)
    png = run_dir / "report.png"
    plot(train, evals, png, str(run_dir))
    (run_dir / "report.txt").write_text(report)
    return png, report

