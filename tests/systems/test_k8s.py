"""k8s/: every file a valid Kubernetes object (core kinds with kubernetes-validate, the PyTorchJob against
the training operator's CRD), and the PyTorchJob's replicas run as local processes with the environment
the Kubeflow operator injects, training together to the end."""
from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import PY, ROOT, clean_env, summary
from tests.multinode import Addresses, Node, image_exec, local_argv, map_paths, quoted, required, run_nodes, tiny
from tests.quick.test_k8s import (
    FAIL,
    K8S,
    RESTART,
    TORCH_RESERVED,
    TRAINER_PORT,
    TRAINJOB_DIR,
    _container,
    _find,
    _job,
    _kubernetes_validate,
    _runtime,
    _trainjob,
    container_env,
    pytorchjob_outcome,
    trainer_pod,
    trainjob_outcome,
)


def operator_env(job: dict, rtype: str, index: int, address) -> list[tuple[str, str]]:
    """What the Kubeflow training operator (v1.9: pkg/controller.v1/pytorch/envvar.go, elastic.go) appends to
    the pytorch container's environment of replica (rtype, index), in its order. address(rtype, index, port)
    -> (host, port) of that replica's Service."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    policy = spec.get("elasticPolicy")

    def port(rt: str) -> int:
        ports = [p for p in _container(replicas[rt])["ports"] if p.get("name") == "pytorchjob-port"]
        assert ports, f"{rt}: no port named pytorchjob-port"
        return ports[0]["containerPort"]

    nproc = spec.get("nprocPerNode")
    if nproc is None and (policy or {}).get("nProcPerNode") is None:
        nproc = "auto"  # the operator's defaulting (pytorch_defaults.go)
    nproc_int = int(nproc) if str(nproc).isdigit() else 1  # WORLD_SIZE counts spec.nprocPerNode only
    total = sum(r.get("replicas", 1) for r in replicas.values())
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in replicas:
        host, mport = address("Master", 0, port("Master"))
        rank = index + (1 if rtype == "Worker" else 0)
        env += [("MASTER_PORT", str(mport)), ("MASTER_ADDR", host),
                ("PET_MASTER_PORT", str(mport)), ("PET_MASTER_ADDR", host),
                ("WORLD_SIZE", str(total * nproc_int)), ("RANK", str(rank)), ("PET_NODE_RANK", str(rank))]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", str(nproc)))
    if policy is None:
        env.append(("PET_NNODES", str(total)))
        return env
    if policy.get("rdzvHost"):
        endpoint = f"{policy['rdzvHost']}:{policy.get('rdzvPort') or port('Worker')}"
    else:
        host, wport = address("Worker", 0, policy.get("rdzvPort") or port("Worker"))
        endpoint = f"{host}:{wport}"
    env += [("PET_RDZV_ENDPOINT", endpoint), ("PET_RDZV_BACKEND", policy.get("rdzvBackend", "c10d"))]
    if "minReplicas" in policy or "maxReplicas" in policy:
        env.append(("PET_NNODES", f"{policy['minReplicas']}:{policy['maxReplicas']}"))
    else:
        env.append(("PET_NNODES", str(replicas["Worker"].get("replicas", 1))))
    if "maxRestarts" in policy:
        env.append(("PET_MAX_RESTARTS", str(policy["maxRestarts"])))
    if policy.get("nProcPerNode") is not None:  # the deprecated field, after spec.nprocPerNode's: it wins
        env.append(("PET_NPROC_PER_NODE", str(policy["nProcPerNode"])))
    if "rdzvId" in policy:
        env.append(("PET_RDZV_ID", policy["rdzvId"]))
    if policy.get("rdzvConf"):
        env.append(("PET_RDZV_CONF", ",".join(f"{kv['key']}={kv['value']}" for kv in policy["rdzvConf"])))
    if policy.get("standalone"):
        env.append(("PET_STANDALONE", ""))
    return env


def pod_argv(c: dict) -> list[str]:
    """Kubernetes over the image: command replaces ENTRYPOINT (and drops CMD), args replace CMD."""
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    return [*image_exec("ENTRYPOINT"), *c.get("args", image_exec("CMD"))]


def pod_names(job: dict) -> list[str]:
    """Each pod's name (its hostname, and its Service's name): Master first, then the Workers."""
    name, replicas = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    return [f"{name}-{rt.lower()}-{i}" for rt in ("Master", "Worker") if rt in replicas
            for i in range(replicas[rt].get("replicas", 1))]


def pod_mounts(pod: dict, c: dict, pod_dir: Path, tmp: Path, claims: dict[str, Path],
               folder: Path = K8S) -> dict[str, Path]:
    """The container's volumes as local folders, by mount path: ConfigMaps (from `folder`'s objects)
    written out, emptyDirs under pod_dir, one folder per PVC shared by all pods (claims)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts, written = {}, []
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            _find("PersistentVolumeClaim", claim, folder)
            path = claims.setdefault(claim, tmp / "pvc" / claim)
        elif "configMap" in v:
            path = pod_dir / "volumes" / m["name"]
            path.mkdir(parents=True, exist_ok=True)
            for key, text in _find("ConfigMap", v["configMap"]["name"], folder)["data"].items():
                written.append(path / key)
                (path / key).write_text(text)
        elif "emptyDir" in v:
            path = pod_dir / "volumes" / m["name"]
        else:
            raise AssertionError(f"unsupported volume {v}")
        if m["mountPath"] != "/dev/shm":  # the host's /dev/shm stands in for the memory emptyDir
            mounts[m["mountPath"]] = path
        path.mkdir(parents=True, exist_ok=True)
    for file in written:  # container paths in a ConfigMap's files (a config naming a task file mounted beside it)
        file.write_text(map_paths(file.read_text(), mounts))
    return mounts


def replica_nodes(job: dict, tmp: Path, real_hosts: bool = False, folder: Path = K8S,
                  extra: list[str] | None = None) -> tuple[list[Node], dict[str, Path]]:
    """Each replica of the job as a process: its command, its container env + the operator's env, its
    volumes as folders (ConfigMaps from `folder`'s objects written out, one folder per PVC shared by all pods),
    then `extra` arguments (by default the tiny CPU overrides). On real hosts (one per pod, named as its pod)
    the Services' names and ports are used as they are; otherwise each name is mapped to 127.0.0.1 and a free
    port per pod."""
    name = job["metadata"]["name"]
    pods = [(rt, i) for rt in ("Master", "Worker") if rt in job["spec"]["pytorchReplicaSpecs"]
            for i in range(job["spec"]["pytorchReplicaSpecs"][rt].get("replicas", 1))]
    services = {f"{name}-{rt.lower()}-{i}": (rt, i) for rt, i in pods}
    addresses = Addresses(list(services))

    def address(rt: str, i: int, port: int) -> tuple[str, int]:  # the Service -> 127.0.0.1, a port per pod
        service = f"{name}-{rt.lower()}-{i}"
        if real_hosts:
            return service, port
        return addresses(service), addresses.port(service, port)

    claims, nodes = {}, []
    for rt, i in pods:
        replica = job["spec"]["pytorchReplicaSpecs"][rt]
        c = _container(replica)
        mounts = pod_mounts(replica["template"]["spec"], c, tmp / f"{rt.lower()}-{i}", tmp, claims, folder)
        env = dict(container_env(c, secrets={}))
        env.update(operator_env(job, rt, i, address))  # appended after the container's: it wins
        argv = local_argv([map_paths(a, mounts) for a in pod_argv(c)])
        argv = tiny(argv) if extra is None else [*argv, *extra]
        nodes.append(Node(f"{rt.lower()}-{i}", argv, clean_env(**env), tmp / f"{rt.lower()}-{i}.log"))
    return nodes, claims


def _with_master(job: dict) -> dict:
    """The same job with a Master replica (the operator then also injects MASTER_*, WORLD_SIZE, RANK)."""
    job = copy.deepcopy(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    replicas["Master"] = copy.deepcopy(replicas["Worker"])
    replicas["Master"]["replicas"] = 1
    replicas["Worker"]["replicas"] -= 1
    return job


def _configmap_from_a_task_file(tmp: Path, mount: str) -> Path:
    """docs/kubernetes.md's ConfigMap form, made as the page says: `kubectl create configmap` from a task file
    (examples/regression.py as my_task.py) and its config (task.name: that file where the jobs mount the
    ConfigMap, `mount`), written over a copy of k8s/'s configmap.yaml: that copy of k8s/."""
    if not shutil.which("kubectl"):
        required("kubectl", "not installed")
    tasks = tmp / "tasks"
    tasks.mkdir()
    shutil.copy(ROOT / "examples" / "regression.py", tasks / "my_task.py")
    cfg = yaml.safe_load((ROOT / "examples" / "regression.yaml").read_text())
    cfg["task"]["name"] = f"{mount}/my_task.py:Regression"
    cfg["train"].update(steps=4, log_every=1)
    cfg.update(log={"wandb": {"mode": "disabled"}, "report": False})
    (tasks / "my.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(["kubectl", "create", "configmap", "ddp-template-config",
                           "--from-file=train.yaml=tasks/my.yaml", "--from-file=tasks/my_task.py",
                           "--dry-run=client", "-o", "yaml"],
                          cwd=tmp, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    folder = tmp / "k8s"
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("trainjob"))
    (folder / "configmap.yaml").write_text(proc.stdout)  # `... -o yaml > k8s/configmap.yaml`, as the page says
    return folder


class _Job:
    """A PyTorchJob's pods run to their end: the job, its pods' results ({name: (exit code, log)}), its PVCs'
    folders, the folder its objects came from."""

    def __init__(self, job: dict, results: dict[str, tuple[int, str]], claims: dict[str, Path], folder: Path):
        self.job, self.results, self.claims, self.folder = job, results, claims, folder


def _run_on_hosts(job: dict, tmp: Path, make_hosts, folder: Path = K8S, extra: list[str] | None = None) -> _Job:
    """Each pod on a real host named as the pod; pods start last first, 5 s apart, and a pod's name
    resolves only once it runs (worker-0, the rendezvous host, comes last)."""
    assert job["spec"]["nprocPerNode"] == "1", "this test runs one CPU process per pod"
    hosts = make_hosts(*pod_names(job), introduce=False)
    nodes, claims = replica_nodes(job, tmp, real_hosts=True, folder=folder, extra=extra)
    assert len(nodes) == 2
    for node in nodes:
        print(f"{node.name}: " + " ".join(f"{k}={v}" for k, v in sorted(node.env.items())
                                          if k.startswith(("PET_", "MASTER_")) or k in ("RANK", "WORLD_SIZE"))
              + f" {quoted(node.argv)}")
    return _Job(job, run_nodes(nodes, hosts=hosts, stagger=5), claims, folder)


@pytest.fixture(scope="module")
def task_file_job(tmp_path_factory) -> _Job:
    """The PyTorchJob as written, its ConfigMap the one docs/kubernetes.md makes from a task file
    (_configmap_from_a_task_file), its two pods on real hosts to the end (4 steps): what
    test_replicas_train_together_with_the_operators_environment[as written] and
    test_a_task_file_in_the_configmap_trains_in_the_pods check, one job for both."""
    tmp = tmp_path_factory.mktemp("task-file-job")
    job = _job()
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    folder = _configmap_from_a_task_file(tmp, mount)
    from tests.hosts import make_hosts_fixture

    hosts = make_hosts_fixture()  # (the make_hosts fixture, for this module)
    try:
        yield _run_on_hosts(job, tmp / "pods", next(hosts), folder=folder, extra=[])
    finally:
        next(hosts, None)  # its hosts removed


@pytest.mark.parametrize("variant", ["as written", "with a Master replica"])
def test_replicas_train_together_with_the_operators_environment(tmp_path, variant, make_hosts, request):
    """Each pod on a real host named as the pod; pods start last first, 5 s apart, and a pod's name
    resolves only once it runs (worker-0, the rendezvous host, comes last). As written, the job trains the
    task file of docs/kubernetes.md's ConfigMap (the task_file_job, which
    test_a_task_file_in_the_configmap_trains_in_the_pods checks too); with a Master replica, k8s/configmap.yaml's
    config on the tiny CPU overrides."""
    if variant == "as written":
        ran, steps = request.getfixturevalue("task_file_job"), 4
    else:
        ran, steps = _run_on_hosts(_with_master(_job()), tmp_path, make_hosts), 6
    job, results = ran.job, ran.results
    policy = job["spec"]["elasticPolicy"]
    port = next(p["containerPort"] for p in _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])["ports"]
                if p.get("name") == "pytorchjob-port")
    if variant == "as written":  # worker-1 started 5 s before worker-0: it waited, then trained. Whether its
        # first probe found the name not resolving yet or the port not open yet depends on how long it took
        # to start (over 5 s on a loaded 2-core machine): either is waiting for the rendezvous host.
        assert "for the rendezvous host: ddp-template-worker-0" in results["worker-1"][1]
    for name, (code, log) in results.items():
        assert code == 0, f"{name} exited {code}\n{log[-4000:]}"
        # What the manifest asks for reached torchrun's command line (through the PET_* variables, the
        # launcher's only source here: the pods' args hold training arguments alone).
        torchrun = next(line for line in log.splitlines() if "train.launch.torchrun" in line)
        for arg in (f"--nnodes={policy['minReplicas']}:{policy['maxReplicas']}",
                    f"--nproc-per-node={job['spec']['nprocPerNode']}", f"--rdzv-id={policy['rdzvId']}",
                    f"--max-restarts={policy['maxRestarts']}", "--rdzv-backend=c10d"):
            assert arg in torchrun.split(), (arg, torchrun)
        # the rendezvous on worker-0's Service (also with a Master: the operator's elastic endpoint), its port
        assert f"--rdzv-endpoint=ddp-template-worker-0:{policy.get('rdzvPort') or port}" in torchrun.split(), torchrun
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    s = summary(ran.claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs"))
    assert s["world_size"] == 2 and s["steps"] == steps and s["ranks_in_sync"], s


def test_a_task_file_in_the_configmap_trains_in_the_pods(task_file_job):
    """docs/kubernetes.md's ConfigMap form: `kubectl create configmap` from a task file (examples/regression.py
    as my_task.py) and its config, whose task.name is that file where both jobs mount the ConfigMap; the
    ConfigMap validates as Kubernetes would and replaces k8s/configmap.yaml; then the PyTorchJob's two pods
    train the task, with the operator's environment and the loader workers unpickling its data sets (on real
    hosts: task_file_job, which test_replicas_train_together_with_the_operators_environment[as written] checks
    too)."""
    job, (trainjob_pod, trainjob_c) = task_file_job.job, trainer_pod(_trainjob(), _runtime())
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    pods = (job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], trainjob_pod)
    for pod, container in zip(pods, (c, trainjob_c), strict=True):  # both jobs mount ddp-template-config at one folder
        volume = next(m for m in container["volumeMounts"] if m["mountPath"] == mount)["name"]
        assert next(v for v in pod["volumes"] if v["name"] == volume)["configMap"]["name"] == "ddp-template-config"
    configmap = yaml.safe_load((task_file_job.folder / "configmap.yaml").read_text())  # kubectl's output
    assert set(configmap["data"]) == {"train.yaml", "my_task.py"}
    kv = _kubernetes_validate()
    kv.validate(configmap, kv.latest_version(), strict=True)
    for name, (code, log) in task_file_job.results.items():
        assert code == 0, f"{name} exited {code}\n{log[-4000:]}"
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    run = task_file_job.claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs")
    s = summary(run)
    assert s["world_size"] == 2 and s["steps"] == 4 and s["ranks_in_sync"], s
    assert "volumes/config/my_task.py:Regression" in (run / "config.yaml").read_text()


def _one_line_hint(proc: subprocess.CompletedProcess, run_dir: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    line = errors[0]
    assert run_dir in line and f"uid {os.getuid()}" in line and "fsGroup" in line and "run.dir=" in line, line
    return line


def test_a_run_volume_the_pod_cannot_write_stops_it_in_one_line(tmp_path):
    """The PVC as an NFS volume that ignores fsGroup: the pod's launcher cannot write it. Here the claim's
    folder is bind-mounted read-only (even root cannot write it) in a mount namespace of the pod's own:
    the launcher says so in one line and exits 2 before torchrun starts (a worker could not even leave its
    usage-error marker there, and torchrun would restart it as a crash)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        required("root and unshare", "a read-only bind mount needs a mount namespace (util-linux, as root)")
    job = _job()
    nodes, claims = replica_nodes(job, tmp_path)
    claim, node = claims["ddp-template-runs"], nodes[0]
    ro = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
          'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(claim)]
    proc = subprocess.run([*ro, *node.argv], cwd=ROOT, env=node.env, capture_output=True, text=True, timeout=300)
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    line = _one_line_hint(proc, str(claim / Path(run_dir).relative_to("/runs")))
    print(line)
    assert "train.launch.torchrun" not in proc.stderr, "torchrun started"
    assert not any(claim.iterdir())


def test_a_file_where_the_run_directory_should_be_is_one_line(tmp_path):
    """python -m train itself (no launcher) makes the run directory where it creates it (train/observe/log.py):
    a file in its place, which fails for any user, is named as the file it is (no permission to fix)."""
    (tmp_path / "runs").write_text("not a folder\n")
    run_dir = tmp_path / "runs" / "x"
    from tests.conftest import TINY

    proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", *TINY, f"run.dir={run_dir}"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert errors[0] == (f"error: the run directory {run_dir} cannot be made: {tmp_path / 'runs'} is a file, not a "
                         f"folder; choose another with run.dir=..."), errors[0]


def trainer_env(job: dict, runtime: dict, index: int) -> list[tuple[str, str]]:
    """What the trainer's torch plugin (pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy)
    upserts into node `index`'s container after the TrainJob's env."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    nproc = str(trainer["numProcPerNode"]) if "numProcPerNode" in trainer else "auto"
    resources = trainer.get("resourcesPerNode", {})
    gpus = {**resources.get("requests", {}), **resources.get("limits", {})}.get("nvidia.com/gpu", 0)
    if nproc == "auto" and not int(gpus):  # auto without GPUs: the CPUs requested per node
        cpu = str(resources.get("requests", {}).get("cpu") or resources.get("limits", {}).get("cpu", "0"))
        nproc = str(max(1, int(float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))))
    return [("PET_NNODES", str(nodes)), ("PET_NPROC_PER_NODE", nproc),
            ("PET_NODE_RANK", str(index)),  # fieldRef: the Job completion index annotation
            ("PET_MASTER_ADDR", f"{name}-node-0-0.{name}"), ("PET_MASTER_PORT", str(TRAINER_PORT))]


class _JobSetPod:
    """A host (tests/hosts.py) as a JobSet pod: its hostname is the pod's name, and its DNS name
    <pod>.<subdomain> (the JobSet's headless Service) resolves too, on itself at once (its /etc/hosts)
    and on the others once it runs."""

    def __init__(self, host, subdomain: str):
        self.host, self.subdomain = host, subdomain
        self.name, self.addr = host.name, host.addr
        host.knows(f"{host.name}.{subdomain}", host.addr)

    def knows(self, other: _JobSetPod) -> None:
        self.host.knows(other.host)
        self.host.knows(f"{other.name}.{self.subdomain}", other.addr)

    def argv(self, argv: list[str]) -> list[str]:
        return self.host.argv(argv)


def test_trainjob_nodes_train_together_with_the_trainers_environment(tmp_path, make_hosts):
    """Each node on a real host named as its pod (ddp-template-node-0-K), its env as the trainer injects
    it; node 1 starts 5 s before node 0, whose DNS name (PET_MASTER_ADDR) resolves only once it runs."""
    job, runtime = _trainjob(), _runtime()
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    assert trainer["numProcPerNode"] == 1 and trainer["numNodes"] == 2, "one CPU process on each of 2 nodes"
    pod, c = trainer_pod(job, runtime)
    pod_names = [f"{name}-node-0-{i}" for i in range(trainer["numNodes"])]
    hosts = [_JobSetPod(h, name) for h in make_hosts(*pod_names, introduce=False)]
    claims, nodes = {}, []
    for i, pod_name in enumerate(pod_names):
        mounts = pod_mounts(pod, c, tmp_path / pod_name, tmp_path, claims, TRAINJOB_DIR)
        env = dict(container_env(c, secrets={}))
        env.update(trainer_env(job, runtime, i))  # upserted after the TrainJob's env: it wins
        argv = local_argv([map_paths(a, mounts) for a in pod_argv(c)])
        nodes.append(Node(pod_name, tiny(argv), clean_env(**env), tmp_path / f"{pod_name}.log"))
        print(f"{pod_name}: " + " ".join(f"{k}={env[k]}" for k in sorted(TORCH_RESERVED)) + f" {quoted(argv)}")
    assert nodes[0].env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}" and nodes[0].env["PET_MASTER_PORT"] == "29500"
    results = run_nodes(nodes, hosts=hosts, stagger=5)
    # Node 1 came first and waited for node 0 (its name not resolving yet, or its port not open yet: which,
    # depends on how long node 1 took to start on a loaded machine).
    assert f"for the rendezvous host: {name}-node-0-0.{name}" in results[pod_names[1]][1]
    for pod_name, (code, log) in results.items():
        assert code == 0, f"{pod_name} exited {code}\n{log[-4000:]}"
        assert "--nnodes=2 " in log and f"--rdzv-endpoint={name}-node-0-0.{name}:29500" in log  # from PET_*
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    s = summary(claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs"))
    assert s["world_size"] == 2 and s["steps"] == 6 and s["ranks_in_sync"], s


def _waiting_pods(tmp: Path) -> dict[str, tuple[dict, list[str], dict[str, str]]]:
    """The second pod of each job (PyTorchJob worker-1, TrainJob node-0-1) as a process: its command, its
    environment as its controller makes it, its volumes as folders. Its rendezvous host (worker-0's Service,
    node 0's DNS name) is not up, so it waits for it, as a pod started first does."""
    job, trainjob, runtime = _job(), _trainjob(), _runtime()
    nodes, _ = replica_nodes(job, tmp / "pytorchjob", real_hosts=True)
    worker = next(n for n in nodes if n.name == "worker-1")
    pod, c = trainer_pod(trainjob, runtime)
    mounts = pod_mounts(pod, c, tmp / "trainjob" / "node-0-1", tmp / "trainjob", {}, TRAINJOB_DIR)
    env = dict(container_env(c, secrets={})) | dict(trainer_env(trainjob, runtime, 1))
    argv = tiny(local_argv([map_paths(a, mounts) for a in pod_argv(c)]))
    return {"PyTorchJob": (job, worker.argv, worker.env), "TrainJob": (runtime, argv, clean_env(**env))}


def test_exit_codes_of_real_pods_meet_the_policy(tmp_path):
    """Each job's pod, run as its controller runs it, ended three ways: a bad config key (exit 2: the job
    fails at once), a SIGTERM while it waits for the rendezvous (the stop path: the launcher's 75, 143 in the
    PyTorchJob: restarted, not counted), the rendezvous host never coming (nothing trained: the stop code too;
    MAX_FAILED_LAUNCHES such launches in a row end in 2, tests/systems/test_hosts.py). Six launchers at once, none
    starts torchrun: a few seconds."""
    import signal
    import time

    from train.launch.command import requeue_exit_code

    outcome = {"PyTorchJob": pytorchjob_outcome, "TrainJob": trainjob_outcome}
    pods = _waiting_pods(tmp_path)
    stop = {kind: requeue_exit_code(env) for kind, (_, _, env) in pods.items()}  # the manifests' REQUEUE_EXIT_CODE
    assert stop == {"PyTorchJob": 143, "TrainJob": 75}
    expected = {("PyTorchJob", "usage"): (2, FAIL), ("PyTorchJob", "stop"): (stop["PyTorchJob"], RESTART),
                ("PyTorchJob", "failed"): (stop["PyTorchJob"], RESTART), ("TrainJob", "usage"): (2, FAIL),
                ("TrainJob", "stop"): (stop["TrainJob"], RESTART), ("TrainJob", "failed"): (stop["TrainJob"], RESTART)}
    procs = {}
    for kind, (obj, argv, env) in pods.items():
        for case in ("usage", "stop", "failed"):
            args = [*argv, "train.no_such_key=1"] if case == "usage" else argv
            case_env = env | {"RDZV_CONF": "join_timeout=1"} if case == "failed" else env
            log = tmp_path / f"{kind}-{case}.log"
            procs[kind, case] = (obj, log, subprocess.Popen(args, cwd=ROOT, env=case_env, stdout=log.open("w"),
                                                            stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for kind in outcome:  # the stop comes while the pod waits for its rendezvous host
            _, log, proc = procs[kind, "stop"]
            deadline = time.monotonic() + 240
            while "waiting up to" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "waiting up to" in log.read_text(), log.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
        for (kind, case), (obj, log, proc) in procs.items():
            code = proc.wait(timeout=240)
            text = log.read_text()
            print(f"{kind} {case}: exit {code}: {text.strip().splitlines()[-1]}")
            assert "train.launch.torchrun" not in text, text[-3000:]
            assert "Traceback" not in text, text[-3000:]
            assert (code, outcome[kind](obj, code)) == expected[kind, case], text[-3000:]
    finally:
        for *_, proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_2x8gpu_pods_dry_run_16_ranks_with_their_controllers_environment(tmp_path):
    """Each pod of the 2 nodes x 8 GPUs variants, its command as the image runs it with the environment its
    controller injects (the operator's; the trainer's torch plugin), in the launcher's dry run: the torchrun
    command it would start, and the batch arithmetic of its 16 ranks checked (16 ranks cannot run here). The
    first pod of each job runs `--dry-run` itself; every pod's command and check are also composed in this
    process as the launcher does (train/launch/command.py), which those dry runs show to be what they print."""
    from tests.quick.test_k8s import PYTORCHJOB_8, TRAINJOB_8
    from train.errors import ConfigError
    from train.launch.command import check_training_args, check_world, parse_args, resolve, torchrun_command

    job = _job(PYTORCHJOB_8)
    nodes, _ = replica_nodes(job, tmp_path / "pytorchjob", real_hosts=True, folder=PYTORCHJOB_8, extra=[])
    trainjob, runtime = _trainjob(TRAINJOB_8), _runtime(TRAINJOB_8)
    pod, c = trainer_pod(trainjob, runtime)
    name = trainjob["metadata"]["name"]
    for i in range(trainjob["spec"]["trainer"]["numNodes"]):
        mounts = pod_mounts(pod, c, tmp_path / f"node-0-{i}", tmp_path, {}, TRAINJOB_8)
        env = dict(container_env(c, secrets={})) | dict(trainer_env(trainjob, runtime, i))
        nodes.append(Node(f"node-0-{i}", local_argv([map_paths(a, mounts) for a in pod_argv(c)]), clean_env(**env),
                          tmp_path / f"node-0-{i}.log"))
    expected = {"worker": ["--nnodes=2:2", "--nproc-per-node=8", "--rdzv-id=ddp-template-2x8gpu",
                           "--rdzv-endpoint=ddp-template-2x8gpu-worker-0:23456"],
                "node": ["--nnodes=2", "--nproc-per-node=8", "--rdzv-id=ddp-template-2x8gpu",
                         f"--rdzv-endpoint={name}-node-0-0.{name}:29500"]}
    assert len(nodes) == 4
    bad_batch = "train.global_batch_size=40"  # a global batch 16 ranks cannot share

    def dry_run(argv: list[str], env: dict) -> tuple[list[str], str | None]:
        """`python -m train.launch --dry-run ARGV`'s torchrun command and usage error (None: none), composed in
        this process as the launcher composes and checks them (launcher.py's _main)."""
        args, train_args = parse_args(argv)
        cmd = torchrun_command(resolve(args, env), train_args)
        try:
            check_world(check_training_args(train_args), cmd)
        except ConfigError as e:
            return cmd, f"error: {e}"
        return cmd, None

    for node in nodes:
        assert node.argv[1:3] == ["-m", "train.launch"], node.argv  # the entrypoint: python -m train.launch
        torchrun, error = dry_run(node.argv[3:], node.env)
        assert error is None, (node.name, error)
        print(f"{node.name}: {shlex.join(torchrun)}")
        for arg in expected[node.name.split("-")[0]]:
            assert arg in torchrun, (node.name, arg, torchrun)
        # A global batch 16 ranks cannot share is refused by the same dry run, in one line, exit 2.
        _, bad = dry_run([*node.argv[3:], bad_batch], node.env)
        assert bad is not None and "does not split evenly over 16 ranks" in bad, (node.name, bad)
        if node.name not in ("worker-0", "node-0-0"):
            continue
        # The first pod of each job: the launcher's own dry run prints that command, and refuses the batch so.
        argv = [*node.argv[:3], "--dry-run", *node.argv[3:]]  # after the entrypoint, python -m train.launch
        proc = subprocess.run(argv, cwd=ROOT, env=node.env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{node.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert next(line for line in proc.stderr.splitlines() if line.startswith("+ ")) == "+ " + shlex.join(torchrun)
        refused = subprocess.run([*argv, bad_batch], cwd=ROOT, env=node.env, capture_output=True, text=True,
                                 timeout=300)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == bad, refused.stderr[-2000:]
