"""SLURM's settings checked without a cluster: the warning signal, submit's defaults and rendezvous."""
from __future__ import annotations

import re

from tests.conftest import PY, ROOT

SBATCH = ROOT / "slurm" / "train.sbatch"


def test_the_warning_signal_comes_early_enough_for_the_stop_budget():
    """SLURM's warning before the time limit (--signal=B:USR1@LEAD) must leave the workers the whole stop
    budget, and a margin for the signal's path (script -> scancel -> every process) and the exit."""
    text = SBATCH.read_text()
    lead = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M)[1])
    budget = int(re.search(r"^export STOP_TIMEOUT=\$\{STOP_TIMEOUT:-(\d+)\}$", text, re.M)[1])
    assert budget + 20 <= lead, (budget, lead)


def test_submit_has_the_sbatch_defaults():
    """train.submit is the same job as slurm/train.sbatch: the same GPUs, CPUs, time limit, warning lead, stop
    budget, requeue bound and name when neither is told otherwise."""
    from train.submit import parse_args, parse_time, stop_budget

    text = SBATCH.read_text()
    line = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
    default = dict(re.findall(r"^\s*(?:export )?(\w+)=\$\{\1:-(\w+)\}", text, re.M))
    args, _ = parse_args(["--nodes", "2"])
    assert (args.gpus_per_node, args.cpus_per_task) == (int(line["gpus-per-node"]), int(line["cpus-per-task"]))
    assert args.time == parse_time(line["time"]) == 240 and args.name == line["job-name"]
    assert args.signal_delay == int(line["signal"].split("@")[1]) and stop_budget(args.signal_delay) == int(
        default["STOP_TIMEOUT"])
    assert args.max_timeouts == int(default["MAX_REQUEUES"])


def test_submit_rendezvous_from_the_allocation(monkeypatch):
    from train.submit import TrainJob, parse_time

    job = TrainJob(["--config", "configs/default.yaml"], "1", str(ROOT), PY)
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
           "SLURM_RESTART_COUNT": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = job.launch_env(env)
    assert out["RDZV_ENDPOINT"] == "gpu07:32342" and out["RDZV_ID"] == "1234" and out["NNODES"] == "2"
    assert out["RDZV_CONF"] == "is_host=0" and out["NPROC_PER_NODE"] == "1"
    assert [parse_time(t) for t in ("90", "01:30:00", "1-00:00:00", "30:30")] == [90, 90, 1440, 31]
    clone = TrainJob.__new__(TrainJob)
    clone.__setstate__(job.__getstate__())
    assert clone.train_args == job.train_args and clone._proc is None


def test_submit_sbatch_options_and_their_refusals(monkeypatch, capsys):
    """--sbatch KEY=VALUE becomes submitit's additional_parameters (KEY alone: a flag). One that train.submit sets
    itself, a malformed one and one given twice are each refused in one line, exit 2, before sbatch is looked for."""
    import train.submit
    from train.submit import main, sbatch_options

    assert sbatch_options(["account=proj", "qos=high", "mem=0", "--constraint=h100|a100", "mail_type=END",
                           "exclusive", "comment=a b=c"]) == {
        "account": "proj", "qos": "high", "mem": "0", "constraint": "h100|a100", "mail-type": "END",
        "exclusive": True, "comment": "a b=c"}

    def no_sbatch(name):
        raise AssertionError(f"looked for {name}: the refusal must come first")

    monkeypatch.setattr(train.submit.shutil, "which", no_sbatch)
    refusals = {
        "nodes=3": "error: --sbatch nodes=3: train.submit sets sbatch's --nodes itself: use train.submit's --nodes",
        "time=10": "error: --sbatch time=10: train.submit sets sbatch's --time itself: use train.submit's --time",
        "gres=gpu:8": "error: --sbatch gres=gpu:8: train.submit sets sbatch's --gres itself: use train.submit's "
                      "--gpus-per-node",
        "signal=USR1@60": "error: --sbatch signal=USR1@60: train.submit sets sbatch's --signal itself: use "
                          "train.submit's --signal-delay",
        "A=proj": "error: --sbatch 'A=proj': expected KEY=VALUE or KEY, with sbatch's long option name "
                  "(account=proj, qos=high, mem=0, constraint=h100, exclusive)",
        "account=": None, "=proj": None, "account proj": None, "comment=a\nb": None,
    }
    for given, line in refusals.items():
        rc = main(["--nodes", "1", "--sbatch", "mem=0", "--sbatch", given, "--", "--config", "configs/default.yaml"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, (given, err)
        assert err.strip() == line if line else err.startswith(f"error: --sbatch {given!r}: expected KEY=VALUE"), err
    rc = main(["--nodes", "1", "--sbatch", "mem=0", "--sbatch", "mem=4G", "--", "--config", "configs/default.yaml"])
    assert rc == 2 and capsys.readouterr().err == "error: --sbatch mem given twice: give each sbatch option once\n"
