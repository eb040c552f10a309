"""Optimizer and learning-rate schedule.

The schedule is a pure function of the step (linear warm-up, then cosine decay), so resuming needs
nothing but the step counter.

How parameters train (`param_groups`, from the task's optional Task.param_groups): a parameter with
requires_grad=False is frozen (the optimizer never holds it, so it has no state); the others go to the task's
group that names them (one at most), or to the group "default" (optim.weight_decay, the schedule's rate). In
every group, matrices and kernels (2 dimensions or more) take the group's weight decay and the rest (biases, norm
scales) none; a group's rate is the schedule's times its lr_scale. Each group becomes one or two of torch's
param groups (its matrices, its vectors), which carry "group" (its name) and "lr_scale".
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn

from train.config import OptimConfig
from train.errors import ConfigError

DEFAULT, FROZEN = "default", "frozen"  # the group of the parameters no task group names; a frozen one's place
GROUP_KEYS = ("name", "params", "lr_scale", "weight_decay")


def build(cfg: OptimConfig, model: nn.Module, loss_scaling: bool = False, groups: object = (),
          task: str = "") -> torch.optim.Optimizer:
    """AdamW or SGD over `model`'s trained parameters, in `groups` (what Task.param_groups returned: checked
    by param_groups, whose ConfigError names `task`). `loss_scaling`: fp16's GradScaler will skip the steps
    whose gradients overflow."""
    torch_groups = param_groups(model, groups, cfg.weight_decay, task)
    params = [p for g in torch_groups for p in g["params"]]
    # optim.fused: one kernel for all parameters' update (GPUs); otherwise torch's default, foreach kernels on
    # a GPU and one parameter at a time on the CPU.
    # Not SGD with momentum under loss scaling: torch's fused SGD (2.11 to 2.15 at least) advances its momentum on a
    # step the GradScaler skips (an overflow, routine in fp16's first steps), and the weights turn NaN a step later;
    # fused AdamW leaves its state alone on such a step. (config.validate refuses optim.fused=true there.)
    unsafe = cfg.name == "sgd" and cfg.momentum > 0 and loss_scaling
    fused = cfg.fused if cfg.fused != "auto" else (not unsafe and all(p.device.type == "cuda" for p in params))
    kernels = {"fused": True} if fused else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(torch_groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0, **kernels)
    return torch.optim.AdamW(torch_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kernels)


def param_groups(model: nn.Module, groups: object, weight_decay: float, task: str = "") -> list[dict]:
    """torch's param groups for `model`: the group "default" (the parameters no group of `groups` names), then
    each of `groups` in order, each as its matrices (its weight decay) then its vectors (none); empty ones left
    out, frozen parameters (requires_grad=False) in none. `groups`: Task.param_groups's list of dicts, checked
    here: a mistake in it is a ConfigError that names the group and the fix."""
    where = f"task {task}: param_groups()" if task else "param_groups()"
    named = list(model.named_parameters())  # a tied parameter once, by its first name
    aliases = list(model.named_parameters(remove_duplicate=False))  # and by each of its names
    if not isinstance(groups, (list, tuple)):
        raise ConfigError(f"{where} must return a list of dicts (name, params, lr_scale, weight_decay), got "
                          f"{type(groups).__name__} (docs/tasks.md)")
    owner: dict[str, str] = {}
    specs = [(DEFAULT, 1.0, weight_decay)]
    for i, group in enumerate(groups):
        name, scale, decay, members = _checked(group, i, named, aliases, weight_decay, where, {s[0] for s in specs})
        for n in members:
            if n in owner:
                raise ConfigError(f"{where}: parameter {n} is in two groups, {owner[n]!r} and {name!r}: name it in "
                                  f"one of them (docs/tasks.md)")
            owner[n] = name
        specs.append((name, scale, decay))
    out = []
    for name, scale, decay in specs:
        mine = [p for n, p in named if owner.get(n, DEFAULT) == name and p.requires_grad]
        matrices, vectors = [p for p in mine if p.ndim > 1], [p for p in mine if p.ndim <= 1]
        if matrices:
            out.append({"params": matrices, "weight_decay": decay, "lr_scale": scale, "group": name})
        if vectors:
            out.append({"params": vectors, "weight_decay": 0.0, "lr_scale": scale, "group": name})
    if not out:
        raise ConfigError(f"task {task}: no parameter of the model trains (every one has requires_grad=False): "
                          f"leave requires_grad on for those that should train (docs/tasks.md)")
    return out


def _checked(group: object, i: int, named: list[tuple[str, nn.Parameter]], aliases: list[tuple[str, nn.Parameter]],
             weight_decay: float, where: str, taken: set[str]) -> tuple[str, float, float, list[str]]:
    """(name, lr_scale, weight_decay, the names of its parameters) of the task's group `i`, or a ConfigError."""
    if not isinstance(group, Mapping):
        raise ConfigError(f"{where}[{i}] is a {type(group).__name__}, not a dict with name, params and lr_scale "
                          f"or weight_decay (docs/tasks.md)")
    name = group.get("name")
    label = f"{where}[{i}]" + (f" ({name!r})" if isinstance(name, str) else "")
    if unknown := [k for k in group if k not in GROUP_KEYS]:
        raise ConfigError(f"{label}: unknown key {unknown[0]!r}; a group has {', '.join(GROUP_KEYS)} "
                          f"(docs/tasks.md)")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name) or name in (DEFAULT, FROZEN) \
            or name in taken:
        why = "taken" if name in (DEFAULT, FROZEN) or name in taken else "not a word of letters, digits and _"
        raise ConfigError(f"{label}: its name {name!r} is {why}: give each group a name of its own (its rate is "
                          f"logged as lr_<name>)")
    values = []
    for key, default in (("lr_scale", 1.0), ("weight_decay", weight_decay)):
        value = group.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{label}: {key} must be a number >= 0, got {value!r}")
        values.append(float(value))
    if "params" not in group:
        raise ConfigError(f"{label}: no params: give the names (or patterns like 'head.*'), the parameters, or "
                          f"a function of the name")
    return name, values[0], values[1], _members(group["params"], named, aliases, label)


def _members(spec: object, named: list[tuple[str, nn.Parameter]], aliases: list[tuple[str, nn.Parameter]],
             label: str) -> list[str]:
    """The names of the parameters a group's `params` names: a function of the name, a name or fnmatch pattern,
    or a list of names, patterns and the model's parameters. Each of them must name one at least (a typo)."""
    first = named[0][0] if named else "?"
    # A tied parameter answers to each of its names (a GPT's wte.weight is its lm_head.weight): its first stands
    by_id = {id(p): n for n, p in named}
    names = [(alias, by_id[id(p)]) for alias, p in aliases]
    if callable(spec) and not isinstance(spec, nn.Parameter):
        found = list(dict.fromkeys(n for alias, n in names if spec(alias)))
        if not found:
            raise ConfigError(f"{label}: its params function is true for no parameter of the model (names as "
                              f"model.named_parameters() gives them, like {first})")
        return found
    items = [spec] if isinstance(spec, (str, torch.Tensor)) else spec
    if not isinstance(items, Iterable):
        raise ConfigError(f"{label}: params is a {type(spec).__name__}: give names, patterns, parameters or a "
                          f"function of the name")
    found: dict[str, None] = {}
    for item in items:
        if isinstance(item, torch.Tensor):
            if id(item) not in by_id:
                raise ConfigError(f"{label}: one of its params is a tensor that is no parameter of the model "
                                  f"(param_groups gets the model as it trains: take them from it)")
            found[by_id[id(item)]] = None
        elif isinstance(item, str):
            hits = [n for alias, n in names if alias == item or fnmatch.fnmatchcase(alias, item)]
            if not hits:
                raise ConfigError(f"{label}: {item!r} matches no parameter of the model (names as "
                                  f"model.named_parameters() gives them, like {first})")
            found |= dict.fromkeys(hits)
        else:
            raise ConfigError(f"{label}: params holds a {type(item).__name__}: give names, patterns, parameters or "
                              f"a function of the name")
    return list(found)


@contextlib.contextmanager
def own_settings(optimizer: torch.optim.Optimizer):
    """Around the load of a saved state dict: its param_groups would bring back the saved run's hyper-parameters
    (weight decay, betas, momentum) and kernel choice (optim.fused switched, or another GPU); this launch's are
    kept, so a relaunch with a changed optim.* value applies it. Each parameter's `step` counter goes where the
    kernels keep it: on the parameter's device for fused ones, on the host for the others (where a counter on a
    GPU would cost a read of the device per parameter and step)."""
    kept = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(step := state.get("step")):
                state["step"] = step.to(device=p.device if on_device else "cpu", dtype=torch.float32)


def start_afresh(optimizer: torch.optim.Optimizer, model: nn.Module, names: set[str]) -> None:
    """The optimizer state of the parameters `names` (trained again after a save that held them frozen) as it is
    before their first step: zeros, step 0 (AdamW's moments; SGD's momentum from zero is the first gradient, as
    from none)."""
    if not names:
        return
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied parameter by any of its names
        if name in names:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value):
                    value.zero_()


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate `lr` for each group, times its lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def rates(optimizer: torch.optim.Optimizer, lr: float) -> dict[str, float]:
    """What the log records of the rates: "lr", the schedule's `lr` (the base rate), and lr_<name>, the rate each
    of the task's groups stepped with (set_lr's: the base times its lr_scale)."""
    out = {"lr": lr}
    for group in optimizer.param_groups:
        if group.get("group", DEFAULT) != DEFAULT:
            out[f"lr_{group['group']}"] = group["lr"]
    return out


def described(optimizer: torch.optim.Optimizer, model: nn.Module) -> str | None:
    """The start's line about how the parameters train, where a task gave groups or froze some: each group's
    parameters, rate and weight decay, and the frozen ones; None for a model that trains whole in one group."""
    seen: dict[str, list] = {}
    for group in optimizer.param_groups:
        seen.setdefault(group.get("group", DEFAULT), []).append(group)
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    frozen = [n for n, p in model.named_parameters() if id(p) not in trained]
    if list(seen) == [DEFAULT] and not frozen:
        return None
    parts = []
    for name, gs in seen.items():
        count = sum(len(g["params"]) for g in gs)
        decay = max(g["weight_decay"] for g in gs)
        parts.append(f"{name} ({count} tensor{'s' if count > 1 else ''}, lr x{gs[0]['lr_scale']:g}, "
                     f"weight decay {decay:g})")
    if frozen:
        parts.append(f"frozen ({len(frozen)}: {', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''})")
    return "parameter groups: " + ", ".join(parts)
