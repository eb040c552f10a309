"""Submit training to SLURM from Python with submitit: the same job as slurm/train.sbatch.

    python -m train.submit --nodes 2 --partition gpu -- --config configs/default.yaml train.steps=20000
    python -m train.submit --nodes 1 --gpus-per-node 2 --cpus-per-task 16 -- --config configs/default.yaml
    python -m train.submit --nodes 2 --gpus-per-node 0 --cpus-per-task 16 -- ...    # CPU nodes
    python -m train.submit --nodes 2 --sbatch account=proj --sbatch qos=high --sbatch mem=0 -- ...  # any sbatch option

The same defaults as slurm/train.sbatch's #SBATCH lines (tests/systems/test_slurm.py holds them equal): 8 GPUs and
64 CPUs per node, 4 hours, the stop signal 180 s before the time limit, the job name, 10 requeues.

One task per node; each runs the shared launcher (python -m train.launch -> torchrun) with a c10d
rendezvous on the first node of the allocation and the job id as rendezvous id. Before the time limit
(--signal-delay seconds) and on preemption SLURM sends SIGTERM to every process of the job: the workers
save a checkpoint at the next step and stop, the launcher exits 75, and submitit calls the job's
checkpoint(), which waits for that and has submitit requeue the job; the requeued job resumes from the
checkpoint (resume: auto). A crash is not requeued. Prints the job id and where the logs are.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from train.errors import EXIT_REQUEUE, EXIT_USAGE, UsageError

# submitit's timeout/preemption signal, read when submitit is imported (here and in the job). SIGTERM,
# not its default SIGUSR2: SLURM signals every process of a job step, and SIGTERM is the one the
# launcher, torchrun and the workers all handle (as a stop); torchrun would die on SIGUSR2.
PREEMPT_SIGNAL = "TERM"
ROOT = Path(__file__).resolve().parents[1]
# slurm/train.sbatch's defaults: --gpus-per-node, --cpus-per-task, --time (minutes), the --signal lead
# (seconds), MAX_REQUEUES and the job name; STOP_TIMEOUT is stop_budget(SIGNAL_DELAY_S), 150 as there.
GPUS_PER_NODE, CPUS_PER_TASK, TIME_MIN, SIGNAL_DELAY_S, MAX_REQUEUES, JOB_NAME = 8, 64, 240, 180, 10, "ddp-template"
# sbatch options this command sets itself (by its own options, or as submitit needs them), which --sbatch may not:
# what to do instead. sbatch's short forms (-N, -t, ...) are refused as --sbatch takes long names only.
OWN = {"nodes": "use train.submit's --nodes", "ntasks": "train.submit runs one task per node: use --nodes",
       "ntasks-per-node": "train.submit runs one task per node: use --nodes and --nproc-per-node",
       "gpus-per-node": "use train.submit's --gpus-per-node", "gpus": "use train.submit's --gpus-per-node",
       "gpus-per-task": "use train.submit's --gpus-per-node", "cpus-per-task": "use train.submit's --cpus-per-task",
       "time": "use train.submit's --time", "signal": "use train.submit's --signal-delay",
       "job-name": "use train.submit's --name", "partition": "use train.submit's --partition",
       "output": "use train.submit's --folder", "error": "use train.submit's --folder",
       "open-mode": "the logs are appended to across requeues: leave it out",
       "requeue": "the job is requeued on the time limit: set how often with --max-timeouts",
       "no-requeue": "the job is requeued on the time limit: set how often with --max-timeouts (0: never)",
       "array": "train.submit submits one job: leave it out", "wait": "use train.submit's --wait",
       "parsable": "train.submit reads sbatch's usual answer: leave it out",
       "test-only": "train.submit reads sbatch's usual answer: leave it out"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def rendezvous_port(job_id: int, restarts: int) -> int:
    """The same port slurm/train.sbatch uses: per job, and per requeue (no TIME_WAIT leftovers)."""
    return 20000 + (job_id * 10 + restarts % 10) % 20000


class TrainJob:
    """What every task of the job runs: the launcher, with the rendezvous taken from the allocation.

    submitit pickles it at submission and, on a requeue, the copy checkpoint() returns."""

    def __init__(self, train_args: list[str], nproc_per_node: str, project_dir: str, python: str):
        self.train_args = list(train_args)
        self.nproc_per_node = nproc_per_node
        self.project_dir = project_dir
        self.python = python
        self._proc: subprocess.Popen | None = None
        self._done: threading.Event | None = None

    def __getstate__(self) -> dict:  # the running launcher is not part of the job's description
        return {k: v for k, v in self.__dict__.items() if k not in ("_proc", "_done")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _proc=None, _done=None)

    def launch_env(self, env: dict[str, str]) -> dict[str, str]:
        """The launcher's environment for this task, from SLURM's variables."""
        import submitit

        job = submitit.JobEnvironment()
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
        first = job.hostnames[0]
        out = dict(env)
        out.setdefault("RDZV_ENDPOINT", f"{first}:{rendezvous_port(int(job.raw_job_id), restarts)}")
        out.setdefault("RDZV_ID", job.raw_job_id)
        out.update(NNODES=str(job.num_nodes), NPROC_PER_NODE=self.nproc_per_node, PYTHONUNBUFFERED="1")
        # The store on node 0 only: needed by nodes emulated on one machine, not by real hosts (see
        # slurm/train.sbatch).
        if "is_host=" not in out.get("RDZV_CONF", ""):
            conf = f"is_host={int(job.node == 0)}"
            out["RDZV_CONF"] = f"{out['RDZV_CONF']},{conf}" if out.get("RDZV_CONF") else conf
        return out

    def __call__(self) -> dict:
        import submitit

        job = submitit.JobEnvironment()
        env = self.launch_env(dict(os.environ))
        cmd = [self.python, "-m", "train.launch", "--", *self.train_args]
        print(f"train.submit: {job}, SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', 0)}, "
              f"rendezvous {env['RDZV_ENDPOINT']} id {env['RDZV_ID']}", file=sys.stderr, flush=True)
        self._proc = subprocess.Popen(cmd, cwd=self.project_dir, env=env)
        self._done = threading.Event()
        # A helper thread reaps the launcher: checkpoint(), which runs in a signal handler on this (main)
        # thread, can then wait for it too without re-entering Popen.wait.
        threading.Thread(target=lambda: (self._proc.wait(), self._done.set()), daemon=True).start()
        while not self._done.wait(1.0):
            pass
        rc = self._proc.returncode
        if rc == 0:
            return {"status": "done", "node": job.node}
        if rc == EXIT_REQUEUE:
            # Stopped after a checkpoint. On global rank 0 submitit's handler requeues the job (it is
            # killed at that point); the other tasks end here.
            if job.global_rank == 0:  # only if the stop signal did not reach this process
                raise RuntimeError("stopped after a checkpoint (exit 75) without submitit's requeue signal; "
                                   "submit the same command again to continue")
            return {"status": "stopped", "node": job.node}
        # Tell global rank 0, whose launcher SLURM now stops (srun --kill-on-bad-exit) and whose checkpoint()
        # must then not requeue: its exit 75 ("nothing lost here") does not undo this node's failure.
        with contextlib.suppress(OSError):
            self._failure_marker(job).write_text(f"{rc}\n")
        raise RuntimeError(f"the launcher on node {job.node} exited with code {rc}; see the lines above")

    @staticmethod
    def _failure_marker(job, node: int | str | None = None) -> Path:
        """The file a node whose launcher failed leaves for this attempt of the job (SLURM_RESTART_COUNT)."""
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        return Path(job.paths.folder) / f"failed_{job.job_id}_{attempt}_node{job.node if node is None else node}"

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on its timeout/preemption signal (global rank 0): the launcher got the same
        SIGTERM; wait until the workers have saved and stopped, then requeue a fresh copy of this job,
        which resumes from that checkpoint. A launcher that failed or was killed is not requeued."""
        from submitit.helpers import DelayedSubmission

        if self._done is not None:
            self._done.wait()
            rc = self._proc.returncode
            print(f"train.submit: the launcher ended with {rc} after the stop signal", file=sys.stderr, flush=True)
            if rc not in (0, EXIT_REQUEUE):  # 0: finished just now; the requeued job sees it complete
                return None
            import submitit

            job = submitit.JobEnvironment()
            failed = sorted(Path(job.paths.folder).glob(self._failure_marker(job, "*").name))
            if failed:  # the stop came from SLURM ending the step after another node failed
                print(f"train.submit: not requeued: {failed[0].name.split('_')[-1]} failed in this attempt (see its "
                      f"log)", file=sys.stderr, flush=True)
                return None
        # submitit requeues next, and SLURM then stops this job with SIGTERM: that one needs no handling
        # (a second checkpoint and `scontrol requeue` of a job already pending would only fail).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return DelayedSubmission(TrainJob(self.train_args, self.nproc_per_node, self.project_dir, self.python))


def stop_budget(signal_delay: int) -> int:
    """STOP_TIMEOUT: seconds the workers get to save after the stop, inside the warning's lead (docs/stops.md)."""
    return max(10, signal_delay - 30)


def parse_time(value: str) -> int:
    """Minutes from MINUTES, HH:MM:SS, MM:SS or D-HH[:MM[:SS]]."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected MINUTES, HH:MM:SS or D-HH:MM:SS, got {value!r}")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is None and b is None:
        minutes = a  # plain minutes
    elif days is None and c is None:
        minutes = a + b / 60  # MM:SS
    else:
        minutes = (days or 0) * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if minutes < 1:
        raise argparse.ArgumentTypeError(f"the time limit must be at least a minute, got {value!r}")
    return int(-(-minutes // 1))


def sbatch_options(given: list[str]) -> dict[str, str | bool]:
    """--sbatch KEY=VALUE (or KEY, a flag) -> submitit's additional_parameters, each an #SBATCH --KEY=VALUE line.
    KEY is sbatch's long option name (a leading -- and _ for - are accepted). Refused with UsageError, before
    anything is queued: a malformed one, one given twice, and one that train.submit sets itself (OWN)."""
    out: dict[str, str | bool] = {}
    for item in given:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--").replace("_", "-")
        if (not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", key) or len(key) < 2 or (eq and not value.strip())
                or "\n" in value or "\r" in value):
            raise UsageError(f"--sbatch {item!r}: expected KEY=VALUE or KEY, with sbatch's long option name "
                             "(account=proj, qos=high, mem=0, constraint=h100, exclusive)")
        if key in OWN or (key == "gres" and "gpu" in value):
            fix = OWN.get(key, "use train.submit's --gpus-per-node")
            raise UsageError(f"--sbatch {item}: train.submit sets sbatch's --{key} itself: {fix}")
        if key in out:
            raise UsageError(f"--sbatch {key} given twice: give each sbatch option once")
        out[key] = value if eq else True
    return out


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.submit", description=__doc__.splitlines()[0],
                                usage="%(prog)s --nodes N [options] [--] [--config FILE] [key=value ...]",
                                allow_abbrev=False)
    p.add_argument("--nodes", type=int, required=True, help="nodes (one task per node)")
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                   help=f"GPUs per node (default {GPUS_PER_NODE}; 0: CPU nodes, with a --cpus-per-task they have)")
    p.add_argument("--nproc-per-node", default=None,
                   help="processes per node (default: --gpus-per-node, else auto: one per GPU, else 2)")
    p.add_argument("--cpus-per-task", type=int, default=CPUS_PER_TASK,
                   help=f"CPUs per node's task (default {CPUS_PER_TASK}: 8 per GPU; scale it with --gpus-per-node)")
    p.add_argument("--time", type=parse_time, default=TIME_MIN,
                   help=f"time limit: MINUTES or HH:MM:SS (default {TIME_MIN // 60:02d}:00:00)")
    p.add_argument("--partition", default=None, help="SLURM partition")
    p.add_argument("--name", default=JOB_NAME, help="job name")
    p.add_argument("--folder", default=None, help="submitit's folder for logs and pickles "
                   "(default: <run dir>/submitit; on a file system every node sees)")
    p.add_argument("--signal-delay", type=int, default=SIGNAL_DELAY_S,
                   help=f"seconds before the time limit at which the job checkpoints and requeues "
                        f"(default {SIGNAL_DELAY_S})")
    p.add_argument("--max-timeouts", type=int, default=MAX_REQUEUES,
                   help=f"requeues after reaching the time limit (default {MAX_REQUEUES})")
    p.add_argument("--python", default=sys.executable, help="interpreter in the job (default: this one)")
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 if it completed")
    p.add_argument("--sbatch", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, by its long name without the dashes: --sbatch account=proj "
                        "--sbatch qos=high --sbatch mem=0 --sbatch constraint=h100 --sbatch exclusive (repeat it)")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args.nodes < 1:
        p.error(f"--nodes must be at least 1, got {args.nodes}")
    if args.gpus_per_node < 0 or args.cpus_per_task < 1:
        p.error("--gpus-per-node must be 0 or more and --cpus-per-task 1 or more, got "
                f"{args.gpus_per_node} and {args.cpus_per_task}")
    if args.nproc_per_node not in (None, "auto") and not (args.nproc_per_node.isdigit() and int(args.nproc_per_node)):
        p.error(f"--nproc-per-node must be a positive number or auto, got {args.nproc_per_node!r}")
    return args, rest


def processes_per_node(args: argparse.Namespace) -> tuple[str, int, str]:
    """NPROC_PER_NODE for the job, the number it comes to, and which option says so: --nproc-per-node, else one
    per GPU asked for, else auto, which is 2 on CPU nodes (train/launch/command.py)."""
    if args.nproc_per_node not in (None, "auto"):
        return args.nproc_per_node, int(args.nproc_per_node), "--nproc-per-node"
    if args.gpus_per_node > 0:
        return args.nproc_per_node or str(args.gpus_per_node), args.gpus_per_node, "one per GPU of --gpus-per-node"
    return "auto", 2, "auto on CPU nodes"


class Written:
    """What a submission writes before sbatch answers, removed again when it fails: submitit's pickle of the job
    (<uuid>.pkl) and its sbatch script (.submission_file_<uuid>.sh) in its folder (the part of --folder before any
    %j) that were not there before, and the folders made for them while they are empty."""

    def __init__(self, folder: Path):
        from submitit.core.utils import JobPaths

        self.folder = JobPaths.get_first_id_independent_folder(folder)
        # the folders this command would make, innermost first
        self.made = [d for d in (self.folder, *self.folder.parents) if not d.exists() and not d.is_symlink()]
        self.before = self._files()

    def _files(self) -> set[Path]:
        return set(self.folder.glob("*.pkl")) | set(self.folder.glob(".submission_file_*.sh"))

    def remove(self) -> None:
        for p in self._files() - self.before:
            with contextlib.suppress(OSError):
                p.unlink()
        for d in self.made:  # only while empty: anything written there since stays
            try:
                d.rmdir()
            except OSError:
                break


def job_state(job_id: str) -> str:
    """SLURM's state of the job (PENDING, RUNNING, COMPLETED, ...), or '' once SLURM forgot it."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    m = re.search(r"\bJobState=(\S+)", out.stdout)
    return m.group(1) if m else ""


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    try:
        extra = sbatch_options(args.sbatch)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from train import config
    from train.config import ConfigError
    from train.launch.command import check_training_args

    # The job runs in the project folder: a config path given from elsewhere is made absolute, and the
    # run directory is resolved there, as the job will.
    train_args = [str(Path(a).resolve()) if i and train_args[i - 1] == "--config" and Path(a).is_file() else a
                  for i, a in enumerate(train_args)]
    train_args = [f"--config={Path(a[9:]).resolve()}" if a.startswith("--config=") and Path(a[9:]).is_file() else a
                  for a in train_args]
    os.chdir(ROOT)
    try:
        cfg = check_training_args(train_args)  # a bad config fails here, not in the queue
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    nproc, per_node, source = processes_per_node(args)
    world = args.nodes * per_node
    try:  # and so does the batch arithmetic of the world the job will start
        config.validate(cfg, world, per_node)
    except ConfigError as e:
        print(f"error: {e}; the job's world size is --nodes {args.nodes} x {per_node} processes per node ({source}): "
              "change them or the setting named", file=sys.stderr)
        return EXIT_USAGE
    if shutil.which("sbatch") is None:
        print("error: sbatch not found: train.submit submits to a SLURM cluster (see docs/slurm.md)",
              file=sys.stderr)
        return EXIT_USAGE
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = PREEMPT_SIGNAL  # before submitit is imported
    try:
        import submitit
    except ImportError:
        print("error: submitit is not installed: pip install -r requirements.txt", file=sys.stderr)
        return EXIT_USAGE

    run_dir = cfg.run_dir.resolve()
    folder = Path(args.folder) if args.folder else run_dir / "submitit"
    written = Written(folder)  # a failed submission leaves nothing of its own behind
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=args.max_timeouts, python=args.python)
    params = dict(job_name=args.name, nodes=args.nodes, ntasks_per_node=1, time=args.time,
                  signal_delay_s=args.signal_delay, stderr_to_stdout=False,
                  # the CPUs asked again for the step (srun 22.05+ does not inherit them; it does read the GPUs
                  # from SLURM_GPUS_PER_NODE), as slurm/train.sbatch does
                  srun_args=["--kill-on-bad-exit=1", f"--cpus-per-task={args.cpus_per_task}"],
                  setup=[f"cd {ROOT}", f"export PYTHONPATH={ROOT}${{PYTHONPATH:+:$PYTHONPATH}}",
                         f"export SUBMITIT_PREEMPT_SIGNAL={PREEMPT_SIGNAL}",
                         # the stop budget, inside the warning's lead time (see "The stop budget" in docs/stops.md)
                         f"export STOP_TIMEOUT=${{STOP_TIMEOUT:-{stop_budget(args.signal_delay)}}}"],
                  additional_parameters={"requeue": True, **extra})
    if args.gpus_per_node > 0:  # 0: CPU nodes, no GPU request at all (as sbatch --gpus-per-node=0)
        params["gpus_per_node"] = args.gpus_per_node
    params["cpus_per_task"] = args.cpus_per_task
    if args.partition:
        params["partition"] = args.partition
    executor.update_parameters(**params)
    try:  # submitit prints sbatch's refusal too: it is in the one line below
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(TrainJob(train_args, nproc, str(ROOT), args.python))
    except Exception as e:  # sbatch refused it: its message says why
        written.remove()
        # sbatch's own lines, in one (its "Try sbatch --help" hint left out); else the exception's last line
        lines = [line.strip() for line in str(e).strip().splitlines()]
        why = "; ".join(line for line in lines if line.startswith("sbatch:")) or (lines[-1] if lines else repr(e))
        if "unrecognized option" in why and extra:
            why += " (an --sbatch KEY is sbatch's long option name: see man sbatch)"
        if "generic resource" in why and args.gpus_per_node:
            why += " (a cluster or partition without GPUs: --gpus-per-node 0 --cpus-per-task N for CPU nodes)"
        print(f"error: submission failed: {why}", file=sys.stderr)
        return 1
    print(f"submitted job {job.job_id}: {args.nodes} node(s), run dir {run_dir}")
    print(f"logs: {job.paths.stdout} and {job.paths.stderr} (rank 0's node; _1_, _2_... for the others)")
    print(f"follow: tail -f {job.paths.stderr}    cancel: scancel {job.job_id}", flush=True)
    if not args.wait:
        return 0
    while (state := job_state(job.job_id)) and state not in TERMINAL:
        time.sleep(2)
    ok = (run_dir / "summary.json").is_file() and state in ("COMPLETED", "")
    print(f"job {job.job_id}: {state or 'ended'}; " + (f"{run_dir / 'summary.json'} written" if ok else
                                                        f"see {job.paths.stderr}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
