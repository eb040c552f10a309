"""How a task's parameters train (Task.param_groups, requires_grad=False; train/optim.py): the groups torch gets,
each group's rate from the schedule, the mistakes a task can make in one line each, and what a resume says of
groups that changed since the checkpoint (train/relaunch.py's group_changes). Trained with real processes, under
DDP and FSDP, by tests/processes/test_param_groups.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from train import optim, relaunch
from train.config import ConfigError, OptimConfig


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)


def _groups(model, groups=(), decay=0.01):
    """{name: [(its parameters' names, weight decay, lr_scale), ...]} of the torch groups built."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list] = {}
    for g in optim.param_groups(model, list(groups), decay, "my_task.py:MyTask"):
        out.setdefault(g["group"], []).append(([names[id(p)] for p in g["params"]], g["weight_decay"], g["lr_scale"]))
    return out


def test_without_groups_matrices_decay_and_vectors_do_not_as_before():
    assert _groups(Net()) == {"default": [(["embed.weight", "body.weight", "head.weight"], 0.01, 1.0),
                                          (["body.bias", "norm.weight", "norm.bias", "head.bias"], 0.0, 1.0)]}


def test_a_head_group_with_its_rate_and_decay_and_a_frozen_embedding():
    """The group's weight decay is its matrices'; its bias takes none, as in the default group. The frozen
    embedding is in no group."""
    net = Net()
    net.embed.weight.requires_grad_(False)
    got = _groups(net, [{"name": "head", "params": ["head.*"], "lr_scale": 10, "weight_decay": 0.1}])
    assert got == {"default": [(["body.weight"], 0.01, 1.0), (["body.bias", "norm.weight", "norm.bias"], 0.0, 1.0)],
                   "head": [(["head.weight"], 0.1, 10.0), (["head.bias"], 0.0, 10.0)]}
    # Without its own weight decay a group takes optim.weight_decay; params may be parameters or a function
    assert _groups(net, [{"name": "head", "params": net.head.parameters()}])["head"] == [
        (["head.weight"], 0.01, 1.0), (["head.bias"], 0.0, 1.0)]
    assert _groups(net, [{"name": "norms", "params": lambda n: n.startswith("norm.")}])["norms"] == [
        (["norm.weight", "norm.bias"], 0.0, 1.0)]


def test_a_tied_parameter_is_named_by_any_of_its_names():
    """A GPT's output layer is its token embedding: a group of "head.*" takes it, by its first name."""
    net = Net()
    net.head = nn.Linear(4, 10, bias=False)
    net.head.weight = net.embed.weight
    assert _groups(net, [{"name": "head", "params": ["head.*"], "lr_scale": 2}])["head"] == [
        (["embed.weight"], 0.01, 2.0)]


def test_the_optimizer_holds_no_frozen_parameter_and_set_lr_scales_each_group():
    net = Net()
    net.embed.weight.requires_grad_(False)
    opt = optim.build(OptimConfig(name="adamw", lr=0.1), net, groups=[{"name": "head", "params": "head.*",
                                                                        "lr_scale": 10}])
    assert net.embed.weight not in {p for g in opt.param_groups for p in g["params"]}
    optim.set_lr(opt, 0.5)
    assert {(g["group"], g["lr"]) for g in opt.param_groups} == {("default", 0.5), ("head", 5.0)}
    assert optim.rates(opt, 0.5) == {"lr": 0.5, "lr_head": 5.0}  # "lr": the base rate, whatever group 0 is
    assert optim.described(opt, net) == ("parameter groups: default (4 tensors, lr x1, weight decay 0.0005), head "
                                         "(2 tensors, lr x10, weight decay 0.0005), frozen (1: embed.weight)")
    plain = Net()
    assert optim.described(optim.build(OptimConfig(), plain), plain) is None  # nothing to say of a plain model


@pytest.mark.parametrize("groups, says", [
    ({"name": "head"}, "must return a list of dicts"),
    ([{"name": "head", "params": ["hed.*"]}], "param_groups()[0] ('head'): 'hed.*' matches no parameter of the model "
                                              "(names as model.named_parameters() gives them, like embed.weight)"),
    ([{"name": "head", "params": ["head.*"], "lr_mult": 10}], "unknown key 'lr_mult'; a group has name, params"),
    ([{"name": "a", "params": ["head.*"]}, {"name": "b", "params": ["head.bias"]}],
     "parameter head.bias is in two groups, 'a' and 'b': name it in one of them"),
    ([{"name": "default", "params": ["head.*"]}], "its name 'default' is taken"),
    ([{"name": "my head", "params": ["head.*"]}], "is not a word of letters, digits and _"),
    ([{"name": "head", "params": ["head.*"], "lr_scale": -1}], "lr_scale must be a number >= 0, got -1"),
    ([{"name": "head", "params": lambda n: False}], "its params function is true for no parameter"),
    ([{"name": "head", "params": [torch.nn.Parameter(torch.zeros(1))]}], "a tensor that is no parameter of the model"),
    ([{"name": "head"}], "no params: give the names"),
])
def test_a_mistake_in_the_groups_is_one_line_naming_the_group(groups, says):
    with pytest.raises(ConfigError) as e:
        optim.param_groups(Net(), groups, 0.01, "my_task.py:MyTask")
    assert str(e.value).startswith("task my_task.py:MyTask: param_groups()") and says in str(e.value), str(e.value)


def test_a_model_with_every_parameter_frozen_is_one_line():
    net = Net().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"^task t: no parameter of the model trains \(every one has "):
        optim.param_groups(net, [], 0.01, "t")


def test_a_parameter_trained_again_starts_with_the_state_of_one_never_stepped():
    """After a resume whose checkpoint held it frozen: AdamW's moments zero and its step 0, so that its next step is
    bitwise a first step."""
    torch.manual_seed(0)
    net = Net()
    opt = optim.build(OptimConfig(name="adamw", lr=0.1), net)
    for _ in range(2):
        net.head(net.body(net.embed(torch.tensor([1, 2])))).sum().backward()
        opt.step()
        opt.zero_grad()
    optim.start_afresh(opt, net, {"head.weight"})
    twin = Net()
    twin.load_state_dict(net.state_dict())
    fresh = optim.build(OptimConfig(name="adamw", lr=0.1), twin)  # never stepped
    for model, o in ((net, opt), (twin, fresh)):
        model.head(model.body(model.embed(torch.tensor([3])))).sum().backward()
        o.step()
    assert torch.equal(net.head.weight, twin.head.weight)
    assert not torch.equal(net.body.weight, twin.body.weight)  # its state was kept: it differs from a fresh one's


def _saved(**groups) -> list[dict]:
    """torch's param groups as a checkpoint holds them: parameters by name."""
    return [{"params": params, "group": name, "lr_scale": scale, "weight_decay": decay}
            for name, (params, scale, decay) in groups.items()]


def test_a_resume_names_what_changed_in_the_groups_as_training():
    then = _saved(default=(["body.weight", "head.weight", "head.bias"], 1.0, 0.01),
                  head=(["norm.weight"], 10.0, 0.0))
    now = _saved(default=(["body.weight", "embed.weight"], 1.0, 0.02),
                 head=(["head.weight", "head.bias", "norm.weight"], 5.0, 0.0))
    found = relaunch.group_changes(then, now)
    assert [str(c) for c in found] == ["param_groups.head.lr_scale 10.0 -> 5.0",  # the default's decay: optim.*
                                       "parameters head.weight and head.bias group default -> group head",
                                       "parameter embed.weight frozen -> group default"]
    assert {c.rule for c in found} == {relaunch.TRAINING}
    assert relaunch.group_changes(now, now) == []
    # A checkpoint of an older release: two groups without names or scales, "default" at 1
    old = [{"params": ["body.weight"], "weight_decay": 0.02}, {"params": ["embed.weight"], "weight_decay": 0.0}]
    assert relaunch.group_changes(old, _saved(default=(["body.weight", "embed.weight"], 1.0, 0.02))) == []
    # On a finished run such a change needs a step: refused in one line
    line = relaunch.refusal(found[2:], "runs/x", 6)
    assert line == ("run runs/x is finished at step 6: parameter embed.weight frozen -> group default would need "
                    "training and no step is left; train more steps (train.steps above 6) or start a new run with "
                    "another run.name")
