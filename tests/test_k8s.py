"""k8s/: every file a valid Kubernetes object (core kinds with kubernetes-validate, the PyTorchJob against
the training operator's CRD), and the PyTorchJob's replicas run as local processes with the environment
the Kubeflow operator injects, training together to the end."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import PY, ROOT, clean_env, summary
from tests.multinode import Addresses, Node, image_exec, local_argv, map_paths, quoted, required, run_nodes, tiny
from train import config

K8S = ROOT / "k8s"
TRAINJOB_DIR = K8S / "trainjob"  # kubectl apply -f k8s/trainjob: its own job, never with k8s/'s
CRD = ROOT.parent / "shared" / "schemas" / "kubeflow.org_pytorchjobs.yaml"
TRAINER_V2 = ROOT.parent / "shared" / "schemas" / "trainer-v2"  # its CRDs and torch-distributed runtime
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def _objects(folder: Path = K8S) -> list[tuple[Path, dict]]:
    """What `kubectl apply -f FOLDER` applies (not recursive): every document of every YAML/JSON file at
    the top of the folder."""
    out = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
            out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def _find(kind: str, name: str | None = None, folder: Path = K8S) -> dict:
    found = [doc for _, doc in _objects(folder) if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {folder}, found {len(found)}"
    return found[0]


def _job() -> dict:
    return _find("PyTorchJob")


def _container(replica: dict) -> dict:
    containers = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    assert len(containers) == 1, "the operator needs a container named pytorch"
    return containers[0]


def _kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        required("kubernetes-validate", "not installed: make dev (requirements-dev.txt) installs it")
    return kubernetes_validate


def _crd_schema() -> dict:
    if not CRD.exists():
        required(str(CRD), "the training operator's PyTorchJob CRD is not beside this checkout")
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "PyTorchJob" and crd["spec"]["group"] == "kubeflow.org"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _strict(schema):
    """Unknown fields are errors, as with kubectl's default (strict) field validation: every object schema
    that lists its properties and does not preserve unknown fields gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


# ------------------------------------------------------------------------------------------ validation

def test_k8s_holds_only_kubernetes_objects():
    objects = _objects()
    assert {doc["kind"] for _, doc in objects} >= {"PyTorchJob", "ConfigMap", "PersistentVolumeClaim"}
    for path, doc in objects:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
        assert doc["kind"] != "Kustomization", f"{path}: kubectl apply -f would reject it; use a subfolder"
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path
        assert "namespace" not in doc["metadata"], f"{path}: kubectl apply -n NAMESPACE chooses it"
    for path in K8S.iterdir():
        assert path.is_dir() or path.suffix in (".yaml", ".yml"), f"kubectl apply -f k8s would read {path}"


def test_core_objects_validate_with_kubernetes_validate():
    kv = _kubernetes_validate()
    version = kv.latest_version()
    checked = 0
    for path, doc in _objects():
        if doc["kind"] == "PyTorchJob":
            # Its pod templates are core objects: validate each as a PodTemplate.
            for rtype, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{doc['metadata']['name']}-{rtype.lower()}"},
                            "template": replica["template"]}
                try:
                    kv.validate(template, version, strict=True)
                except Exception as e:
                    pytest.fail(f"{path}: {rtype} pod template: {e}")
                checked += 1
            continue
        try:
            kv.validate(doc, version, strict=True)  # an invalid object, an unknown field or kind
        except Exception as e:
            pytest.fail(f"{path}: {doc['kind']} {doc['metadata']['name']}: {e}")
        checked += 1
    assert checked >= 3


def test_pytorchjob_validates_against_the_operators_crd():
    import jsonschema

    schema = _strict(_crd_schema())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_job()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    # And the check bites: a misplaced field is refused.
    bad = copy.deepcopy(_job())
    bad["spec"]["elasticPolicy"]["nprocPerNode"] = 1
    assert list(validator.iter_errors(bad))


def test_pytorchjob_conventions():
    job = _job()
    spec, policy = job["spec"], job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    assert policy["maxRestarts"] >= 1 and policy.get("rdzvId")
    # The v1.9 operator's webhook warns on elasticPolicy.nProcPerNode (deprecated) and refuses it beside
    # spec.nprocPerNode; the operator injects spec.nprocPerNode as PET_NPROC_PER_NODE.
    assert "nProcPerNode" not in policy and int(spec["nprocPerNode"]) >= 1
    # None (the operator's default) leaves an elastic job's pods, and their GPUs, behind once it ends.
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic: workers only, rendezvous at worker 0"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    # The pods follow the launcher's exit codes (the policy itself: test_exit_codes_*).
    assert worker["restartPolicy"] == "ExitCode" and "backoffLimit" not in spec["runPolicy"]
    pod = worker["template"]["spec"]
    c = _container(worker)
    assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in c["ports"]
    assert c["image"] == f"ddp-template:{VERSION}"
    assert "command" not in c, "the image's entrypoint, the shared launcher, runs"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == spec["nprocPerNode"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in mounts["/tmp"], "HOME and caches (the image's ENV) on a writable scratch volume"
    claim = mounts["/runs"]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in _find("PersistentVolumeClaim", claim)["spec"]["accessModes"]
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    assert run_dir.startswith("/runs/"), "runs and checkpoints on the PVC, so a restarted pod resumes"
    config_path = Path(c["args"][c["args"].index("--config") + 1])
    config_map = next(v["configMap"]["name"] for p, v in mounts.items()
                      if "configMap" in v and config_path.is_relative_to(p))
    assert config_path.name in _find("ConfigMap", config_map)["data"]

    wandb = next(e for e in c["env"] if e["name"] == "WANDB_API_KEY")["valueFrom"]["secretKeyRef"]
    assert wandb["optional"] is True
    assert not any("value" in e and re.search(r"KEY|TOKEN|PASSWORD|SECRET", e["name"]) for e in c["env"])

    pod_sc, sc = pod["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] and sc["runAsNonRoot"] and pod_sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert pod_sc["seccompProfile"]["type"] == sc["seccompProfile"]["type"] == "RuntimeDefault"


def test_configmap_config_is_valid_at_every_allowed_size(tmp_path):
    """The ConfigMap's config with the job's overrides loads, and its batch arithmetic holds for every world
    size the elastic job may run at (minReplicas..maxReplicas nodes)."""
    job = _job()
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    path = tmp_path / "train.yaml"
    path.write_text(_find("ConfigMap", "ddp-template-config")["data"]["train.yaml"])
    cfg = config.load(str(path), c["args"][c["args"].index("--config") + 2:])
    policy = job["spec"]["elasticPolicy"]
    for nodes in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        config.validate(cfg, nodes * int(job["spec"]["nprocPerNode"]))
    # A membership change (a pod joins or leaves) gives the workers torch's fixed 30 s to save, whatever
    # STOP_TIMEOUT says: the periodic checkpoints bound what a save that does not fit loses.
    assert 0 < cfg.checkpoint.every <= cfg.train.steps // 2, cfg.checkpoint


# ------------------------------------------------------------------------- the operator, emulated

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


def container_env(c: dict, secrets: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """The container's own env as the kubelet resolves it (an optional Secret that is absent: unset)."""
    out = []
    for e in c.get("env", []):
        if "value" in e:
            out.append((e["name"], str(e["value"])))
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            value = secrets.get(ref["name"], {}).get(ref["key"])
            if value is None:
                assert ref.get("optional"), f"{e['name']}: the pod would not start without Secret {ref['name']}"
                continue
            out.append((e["name"], value))
        else:
            raise AssertionError(f"{e['name']}: unsupported valueFrom {e['valueFrom']}")
    return out


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


@pytest.mark.parametrize("variant", ["as written", "with a Master replica"])
def test_replicas_train_together_with_the_operators_environment(tmp_path, variant, make_hosts):
    """Each pod on a real host named as the pod; pods start last first, 5 s apart, and a pod's name
    resolves only once it runs (worker-0, the rendezvous host, comes last)."""
    job = _job() if variant == "as written" else _with_master(_job())
    policy = job["spec"]["elasticPolicy"]
    assert job["spec"]["nprocPerNode"] == "1", "this test runs one CPU process per pod"
    hosts = make_hosts(*pod_names(job), introduce=False)
    nodes, claims = replica_nodes(job, tmp_path, real_hosts=True)
    assert len(nodes) == 2
    port = next(p["containerPort"] for p in _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])["ports"]
                if p.get("name") == "pytorchjob-port")
    for node in nodes:
        print(f"{node.name}: " + " ".join(f"{k}={v}" for k, v in sorted(node.env.items())
                                          if k.startswith(("PET_", "MASTER_")) or k in ("RANK", "WORLD_SIZE"))
              + f" {quoted(node.argv)}")
    results = run_nodes(nodes, hosts=hosts, stagger=5)
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
    s = summary(claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs"))
    assert s["world_size"] == 2 and s["steps"] == 6 and s["ranks_in_sync"], s


# ------------------------------------------------------------------------- your own task

# Every `image:` of the manifests, by where it is (docs/kubernetes.md, "Your own task", names each): an image of
# the user's goes into all of them. The TrainJob has two, its own (which wins) and its runtime's container's.
IMAGE_FIELDS = {
    "k8s/pytorchjob.yaml": ["spec.pytorchReplicaSpecs.Worker.template.spec.containers[pytorch].image"],
    "k8s/trainjob/trainjob.yaml": ["spec.trainer.image"],
    "k8s/trainjob/runtime.yaml": ["spec.template.spec.replicatedJobs[node].template.spec.template.spec"
                                  ".containers[node].image"],
}


def _image_fields(value, where: str = "") -> list[tuple[str, str]]:
    """(path, value) of every `image` key, list items by their name."""
    if isinstance(value, dict):
        return [found for k, v in value.items()
                for found in ([(f"{where}.{k}".lstrip("."), v)] if k == "image" else
                              _image_fields(v, f"{where}.{k}".lstrip(".")))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value)
                for found in _image_fields(v, f"{where}[{v.get('name', i) if isinstance(v, dict) else i}]")]
    return []


def test_every_image_field_of_the_manifests_is_named_in_the_docs_and_holds_the_tag_make_builds():
    found = {str(path.relative_to(ROOT)): [] for folder in (K8S, TRAINJOB_DIR) for path, _ in _objects(folder)}
    for folder in (K8S, TRAINJOB_DIR):
        for path, doc in _objects(folder):
            for where, image in _image_fields(doc):
                found[str(path.relative_to(ROOT))].append(where)
                assert image == f"ddp-template:{VERSION}", (path, where, image)
    assert {k: v for k, v in found.items() if v} == IMAGE_FIELDS
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    section = docs[docs.index("## Your own task"):].split("\n## ")[0]
    for path in IMAGE_FIELDS:
        assert path in section, f"docs/kubernetes.md, Your own task: names no image field of {path}"
    assert "spec.trainer.image" in section and "runtime.yaml" in section, section


def test_a_task_file_in_the_configmap_trains_in_the_pods(tmp_path):
    """docs/kubernetes.md's ConfigMap form: `kubectl create configmap` from a task file (examples/regression.py
    as my_task.py) and its config, whose task.name is that file where both jobs mount the ConfigMap; the
    ConfigMap validates as Kubernetes would and replaces k8s/configmap.yaml; then the PyTorchJob's two pods
    train the task, with the operator's environment and the loader workers unpickling its data sets."""
    if not shutil.which("kubectl"):
        required("kubectl", "not installed")
    job, (trainjob_pod, trainjob_c) = _job(), trainer_pod(_trainjob(), _runtime())
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "config")
    pods = (job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"], trainjob_pod)
    for pod, container in zip(pods, (c, trainjob_c), strict=True):  # both jobs mount ddp-template-config at one folder
        volume = next(m for m in container["volumeMounts"] if m["mountPath"] == mount)["name"]
        assert next(v for v in pod["volumes"] if v["name"] == volume)["configMap"]["name"] == "ddp-template-config"
    tasks = tmp_path / "tasks"
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
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    configmap = yaml.safe_load(proc.stdout)
    assert set(configmap["data"]) == {"train.yaml", "my_task.py"}
    kv = _kubernetes_validate()
    kv.validate(configmap, kv.latest_version(), strict=True)
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("trainjob"))
    (folder / "configmap.yaml").write_text(proc.stdout)  # `... -o yaml > k8s/configmap.yaml`, as the page says
    nodes, claims = replica_nodes(job, tmp_path / "pods", folder=folder, extra=[])
    results = run_nodes(nodes)
    for name, (code, log) in results.items():
        assert code == 0, f"{name} exited {code}\n{log[-4000:]}"
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    run = claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs")
    s = summary(run)
    assert s["world_size"] == 2 and s["steps"] == 4 and s["ranks_in_sync"], s
    assert "volumes/config/my_task.py:Regression" in (run / "config.yaml").read_text()


# ------------------------------------------------------------------------- an unwritable run volume

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


# ------------------------------------------------------------------- Kubeflow Trainer v2: the TrainJob

TORCH_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
TRAINER_PORT = 29500  # pkg/constants: ContainerTrainerPort, PET_MASTER_PORT


def _trainjob() -> dict:
    return _find("TrainJob", folder=TRAINJOB_DIR)


def _v2(name: str) -> dict:
    path = TRAINER_V2 / name
    if not path.exists():
        required(str(path), "Kubeflow Trainer v2's CRDs and runtime are not beside this checkout")
    return yaml.safe_load(path.read_text())


def _runtime() -> dict:
    """The runtime the TrainJob names: its own TrainingRuntime, shipped beside it (k8s/trainjob/), or a
    ClusterTrainingRuntime as the trainer installs it (torch-distributed)."""
    ref = _trainjob()["spec"]["runtimeRef"]
    assert ref.get("apiGroup", "trainer.kubeflow.org") == "trainer.kubeflow.org"
    if ref.get("kind", "ClusterTrainingRuntime") == "TrainingRuntime":  # namespaced: applied with the TrainJob
        return _find("TrainingRuntime", ref["name"], TRAINJOB_DIR)
    runtime = _v2("torch_distributed.yaml")
    assert (ref.get("kind", "ClusterTrainingRuntime"), ref["name"]) == (runtime["kind"], runtime["metadata"]["name"])
    return runtime


def _runtime_crd(runtime: dict) -> str:
    return {"TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
            "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml"}[runtime["kind"]]


def _node_job(runtime: dict) -> dict:
    """The batch/v1 Job spec of the runtime's replicated job `node` (what JobSet creates per replica)."""
    rjob = next(r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node")
    return rjob["template"]["spec"]


def _crd_validator(name: str):
    import jsonschema

    crd = _v2(name)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _webhook_errors(job: dict, runtime: dict) -> list[str]:
    """What the trainer's admission webhook refuses, read from its source (torch.go's Validate, the jobset
    plugin's runtimePatches checks, the CRD's CEL rules), for the fields this TrainJob uses."""
    errors = []
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) or len(job["metadata"]["name"]) > 63:
        errors.append("metadata.name must be an RFC 1035 label")
    trainer = job["spec"].get("trainer", {})
    if reserved := TORCH_RESERVED & {e["name"] for e in trainer.get("env", [])}:
        errors.append(f"spec.trainer.env: must not have reserved envs {sorted(reserved)}")
    if trainer.get("numProcPerNode", 1) < 1:
        errors.append("numProcPerNode must be greater than or equal to 1")
    jobs = {r["name"]: {c["name"] for c in r["template"]["spec"]["template"]["spec"]["containers"]}
            for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    for patch in job["spec"].get("runtimePatches", []):
        host, _, path = patch["manager"].partition("/")
        if not (path and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", host)):
            errors.append(f"runtimePatches.manager {patch['manager']!r}: not a domain-prefixed path")
        for rjob in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            if rjob["name"] not in jobs:
                errors.append(f"runtimePatches: no replicated job {rjob['name']} in the runtime")
                continue
            for c in rjob["template"]["spec"]["template"]["spec"].get("containers", []):
                if c["name"] not in jobs[rjob["name"]]:
                    errors.append(f"runtimePatches: no container {c['name']} in the runtime's {rjob['name']}")
                elif c.get("env") and c["name"] == "node":
                    errors.append("runtimePatches: must not have envs for the node container")
    return errors


def _runtime_webhook_errors(runtime: dict) -> list[str]:
    """What the trainer's runtime webhook refuses (pkg/webhooks/trainingruntime_webhook.go,
    validateReplicatedJobs): a replicated job labelled as the trainer step has 1 replica and a container
    named node."""
    errors = []
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if rjob.get("template", {}).get("metadata", {}).get("labels", {}).get(
                "trainer.kubeflow.org/trainjob-ancestor-step") == "trainer":
            if rjob.get("replicas", 1) != 1:
                errors.append(f"{rjob['name']}: replicas always must be 1")
            if "node" not in {c["name"] for c in rjob["template"]["spec"]["template"]["spec"]["containers"]}:
                errors.append(f"{rjob['name']}: must contain the required container for the ancestor: trainer")
    return errors


def _job_errors(spec: dict) -> list[str]:
    """What the API server refuses in a batch/v1 Job's podFailurePolicy (kubernetes
    pkg/apis/batch/validation/validation.go: validatePodFailurePolicy and its rules)."""
    policy = spec.get("podFailurePolicy")
    if policy is None:
        return []
    pod = spec["template"]["spec"]
    errors = []
    if pod.get("restartPolicy") != "Never":  # JobSet's webhook defaults an unset one to OnFailure
        errors.append("template.spec.restartPolicy: only Never is supported when podFailurePolicy is specified")
    names = {c["name"] for c in pod.get("containers", []) + pod.get("initContainers", [])}
    for i, rule in enumerate(policy["rules"]):
        where = f"podFailurePolicy.rules[{i}]"
        action = rule.get("action")
        if action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
            errors.append(f"{where}.action: FailIndex requires the backoffLimitPerIndex to be set")
        elif action not in ("FailJob", "FailIndex", "Ignore", "Count"):
            errors.append(f"{where}.action: unsupported {action!r}")
        if ("onExitCodes" in rule) == bool(rule.get("onPodConditions")):
            errors.append(f"{where}: exactly one of onExitCodes and onPodConditions")
        if on := rule.get("onExitCodes"):
            values = on.get("values", [])
            if on.get("operator") not in ("In", "NotIn"):
                errors.append(f"{where}.onExitCodes.operator: unsupported {on.get('operator')!r}")
            if "containerName" in on and on["containerName"] not in names:
                errors.append(f"{where}.onExitCodes.containerName: must be one of the container names in the pod")
            if not values or len(values) > 255 or values != sorted(set(values)):
                errors.append(f"{where}.onExitCodes.values: 1 to 255 values, unique and ordered")
            if on.get("operator") == "In" and 0 in values:
                errors.append(f"{where}.onExitCodes.values: must not be 0 for the In operator")
        for cond in rule.get("onPodConditions", []):
            if cond.get("status") not in ("True", "False", "Unknown"):
                errors.append(f"{where}.onPodConditions.status: True, False or Unknown")
    return errors


def trainer_pod(job: dict, runtime: dict) -> tuple[dict, dict]:
    """(pod spec, container `node`) of the TrainJob's nodes as the trainer builds them: the runtime's
    replicated job `node`, the TrainJob's image, command/args, resources and env, its runtimePatches, and
    the port 29500 the torch plugin adds."""
    rjob = next(r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node")
    pod = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
    c = next(c for c in pod["containers"] if c["name"] == "node")
    trainer = job["spec"]["trainer"]
    c["image"] = trainer["image"]
    for key in ("command", "args"):
        if key in trainer:
            c[key] = trainer[key]
    if "resourcesPerNode" in trainer:
        c["resources"] = trainer["resourcesPerNode"]
    c["env"] = [e for e in c.get("env", []) if e["name"] not in {t["name"] for t in trainer.get("env", [])}]
    c["env"] += trainer.get("env", [])
    for patch in job["spec"].get("runtimePatches", []):
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            for key, value in rj["template"]["spec"]["template"]["spec"].items():
                if key != "containers":
                    pod[key] = copy.deepcopy(value)
                    continue
                for cpatch in value:
                    target = next(x for x in pod["containers"] if x["name"] == cpatch["name"])
                    target.update({k: copy.deepcopy(v) for k, v in cpatch.items() if k != "name"})
    c.setdefault("ports", []).append({"containerPort": TRAINER_PORT, "protocol": "TCP"})
    return pod, c


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


def test_kubectl_apply_k8s_creates_exactly_one_job_and_k8s_trainjob_the_other():
    jobs = {"PyTorchJob", "TrainJob"}
    assert [doc["kind"] for _, doc in _objects() if doc["kind"] in jobs] == ["PyTorchJob"]
    assert [doc["kind"] for _, doc in _objects(TRAINJOB_DIR) if doc["kind"] in jobs] == ["TrainJob"]
    for path, doc in _objects(TRAINJOB_DIR):
        assert "namespace" not in doc["metadata"], f"{path}: kubectl apply -n NAMESPACE chooses it"
        if doc["kind"] in ("ConfigMap", "PersistentVolumeClaim"):  # the same objects: applying both is a no-op
            assert doc == _find(doc["kind"], doc["metadata"]["name"]), f"{path} differs from k8s/'s"
    assert not [p for p in TRAINJOB_DIR.iterdir() if p.is_dir() or p.suffix not in (".yaml", ".yml")]


def test_trainjob_validates_against_the_trainers_crds_and_webhook():
    job, runtime = _trainjob(), _runtime()
    assert runtime["kind"] == "TrainingRuntime", "the TrainJob's own runtime, shipped beside it in k8s/trainjob"
    for validator, doc in ((_crd_validator("trainer.kubeflow.org_trainjobs.yaml"), job),
                           (_crd_validator(_runtime_crd(runtime)), runtime)):
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    assert not _webhook_errors(job, runtime) and not _runtime_webhook_errors(runtime)
    assert not _job_errors(_node_job(runtime))
    # And the checks bite: an unknown field, a reserved variable, env patched into the node container, a
    # podFailurePolicy on pods that restart in place, exit codes out of order, a misplaced Job field.
    validator = _crd_validator("trainer.kubeflow.org_trainjobs.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["nprocPerNode"] = 1
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["env"].append({"name": "PET_MASTER_PORT", "value": "23456"})
    assert _webhook_errors(bad, runtime)
    bad = copy.deepcopy(job)
    bad["spec"]["runtimePatches"] = [{"manager": "ddp-template.local/manifest", "trainingRuntimeSpec": {
        "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
            "containers": [{"name": "node", "env": [{"name": "A", "value": "1"}]}]}}}}}]}}}}]
    assert _webhook_errors(bad, runtime)
    bad = copy.deepcopy(runtime)
    _node_job(bad)["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert _job_errors(_node_job(bad))
    bad = copy.deepcopy(runtime)
    _node_job(bad)["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] = [75, 2]
    assert _job_errors(_node_job(bad))
    bad = copy.deepcopy(runtime)
    _node_job(bad)["podFailurePolicy"]["rules"][0]["onExitCode"] = {}
    assert list(_crd_validator(_runtime_crd(runtime)).iter_errors(bad))


def test_trainjob_pod_validates_and_follows_the_conventions(tmp_path):
    kv = _kubernetes_validate()
    job, runtime = _trainjob(), _runtime()
    pod, c = trainer_pod(job, runtime)
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "ddp-template-node"},
                "template": {"spec": pod}}
    try:
        kv.validate(template, kv.latest_version(), strict=True)
    except Exception as e:
        pytest.fail(f"the TrainJob's node pod: {e}")
    trainer = job["spec"]["trainer"]
    assert c["image"] == f"ddp-template:{VERSION}" and "command" not in c, "the image's entrypoint runs"
    assert str(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]) == str(trainer["numProcPerNode"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory" and "emptyDir" in volumes[mounts["/tmp"]]
    claim = volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in _find("PersistentVolumeClaim", claim, TRAINJOB_DIR)["spec"]["accessModes"]
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    assert run_dir.startswith("/runs/") and run_dir != next(
        a.split("=", 1)[1] for a in _container(_job()["spec"]["pytorchReplicaSpecs"]["Worker"])["args"]
        if a.startswith("run.dir=")), "its own run directory: both jobs may run at once"
    pod_sc, sc = pod["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] and sc["runAsNonRoot"] and pod_sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The config loads with the job's overrides and its batch arithmetic holds for the job's world size.
    path = tmp_path / "train.yaml"
    path.write_text(_find("ConfigMap", "ddp-template-config", TRAINJOB_DIR)["data"]["train.yaml"])
    cfg = config.load(str(path), c["args"][c["args"].index("--config") + 2:])
    config.validate(cfg, trainer["numNodes"] * trainer["numProcPerNode"])


def test_grace_period_is_the_stop_budget_plus_the_launchers_margin_in_each_manifest():
    """terminationGracePeriodSeconds (when the kubelet SIGKILLs) = STOP_TIMEOUT (the seconds torchrun gives
    the workers to save) + train/launch/command.py's GRACE_MARGIN_S (torchrun's and the launcher's own exit): one
    stop budget, so raising one without the other fails here. The TrainJob's pod is built as the trainer
    builds it (its runtime's pod and env, the TrainJob's env over it)."""
    from train.launch.command import GRACE_MARGIN_S

    worker = _job()["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod, c = trainer_pod(_trainjob(), _runtime())
    for name, grace, env in (("PyTorchJob", worker["template"]["spec"]["terminationGracePeriodSeconds"],
                              _container(worker)["env"]),
                             ("TrainJob", pod["terminationGracePeriodSeconds"], c["env"])):
        stop = [int(e["value"]) for e in env if e["name"] == "STOP_TIMEOUT"]
        assert len(stop) == 1 and stop[0] > 0, f"{name}: STOP_TIMEOUT set once: {stop}"
        assert grace == stop[0] + GRACE_MARGIN_S, \
            f"{name}: terminationGracePeriodSeconds={grace}, STOP_TIMEOUT={stop[0]} + {GRACE_MARGIN_S}"


def _kueue_option(path: Path) -> tuple[str, dict]:
    """(queue name, the job with its commented-out kueue.x-k8s.io/queue-name label put back) of a manifest."""
    text = path.read_text()
    found = re.findall(r"^(\s*)# (kueue\.x-k8s\.io/queue-name: (\S+))", text, re.M)
    assert len(found) == 1, f"{path}: one commented-out kueue.x-k8s.io/queue-name label"
    indent, line, queue = found[0]
    docs = [d for d in yaml.safe_load_all(text.replace(f"{indent}# {line}", f"{indent}{line}", 1)) if d]
    job = next(d for d in docs if d["kind"] in ("PyTorchJob", "TrainJob"))
    return queue, job


def test_both_jobs_carry_the_kueue_queue_label_as_an_option():
    """Uncommenting the label gives a job that its CRD accepts, labelled with the LocalQueue, and otherwise
    the same job (Kueue then creates it suspended and starts it when the queue admits it: docs/kubernetes.md)."""
    import jsonschema

    for path, job, validator in (
            (K8S / "pytorchjob.yaml", _job(), jsonschema.Draft7Validator(_strict(_crd_schema()))),
            (TRAINJOB_DIR / "trainjob.yaml", _trainjob(), _crd_validator("trainer.kubeflow.org_trainjobs.yaml"))):
        queue, labelled = _kueue_option(path)
        assert labelled["metadata"]["labels"].pop("kueue.x-k8s.io/queue-name") == queue
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", queue), queue
        assert labelled == job, f"{path}: the label is the only change"
        labelled["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = queue
        assert not list(validator.iter_errors(labelled)), path
        assert "suspend" not in str(job["spec"].get("runPolicy", {})) and "suspend" not in job["spec"], \
            f"{path}: Kueue suspends it; without Kueue it starts at once"


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


# --------------------------------------------------- exit codes: what the controllers do with a pod's end
#
# The launcher ends a pod with 75 (stopped after a checkpoint: restart me), 2 (usage error: do not retry)
# or 1 (failed). What each job's controller then does is read from the manifests, as the controllers read
# them: the PyTorchJob's restartPolicy (training-operator v1.9, pkg/controller.v1/common/pod.go,
# ReconcilePods; pkg/util/train/train_util.go, IsRetryableExitCode; pkg/core/job.go, PastBackoffLimit)
# and the TrainJob runtime's Job podFailurePolicy (kubernetes pkg/controller/job/pod_failure_policy.go,
# matchPodFailurePolicy; a failed Job fails a JobSet without failurePolicy: jobset
# pkg/controllers/failure_policy.go, executeFailurePolicy).

RESTART, COUNT, FAIL = "restarted, not counted", "restarted, counted", "the job fails"


def pytorchjob_outcome(job: dict, exit_code: int, rtype: str = "Worker") -> str:
    """What the training operator does with a pod of `rtype` whose container `pytorch` exited non-zero."""
    policy = job["spec"]["pytorchReplicaSpecs"][rtype].get("restartPolicy", "Never")
    if policy == "ExitCode":  # the pod's restartPolicy is Never: a failed pod is deleted and created anew
        # (restartCount 0, so PastBackoffLimit, which sums the restartCount of running pods, never sees it)
        # for 128-255, and the job is failed for 1-127.
        return RESTART if exit_code >= 128 else FAIL
    if policy in ("OnFailure", "Always"):  # the kubelet restarts the container: its restartCount counts
        return COUNT
    return FAIL  # Never: not restarted


def trainjob_outcome(runtime: dict, exit_code: int, container: str = "node", disrupted: bool = False) -> str:
    """What the Job controller does with a failed pod of the runtime's node Job: the first podFailurePolicy
    rule that matches (an exit code of a terminated container, non-zero; or a pod condition) decides:
    Ignore (replaced, not counted), FailJob, Count; no rule matching counts."""
    spec = _node_job(runtime)
    assert spec["template"]["spec"].get("restartPolicy") == "Never", "a failed pod is replaced by its Job"
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        if on := rule.get("onExitCodes"):
            matched = exit_code != 0 and on.get("containerName") in (None, container) and (
                (exit_code in on["values"]) == (on["operator"] == "In"))
        else:
            matched = disrupted and any(c["type"] == "DisruptionTarget" and c.get("status") == "True"
                                        for c in rule.get("onPodConditions", []))
        if matched:
            return {"Ignore": RESTART, "Count": COUNT, "FailJob": FAIL}[rule["action"]]
    return COUNT


def job_state(outcome, exits: list[int], limit: int | None, fails_above: bool = True) -> tuple[str, int]:
    """(Running or Failed, pods counted) after these pod exits, one after another: counted failures past the
    limit fail the job (a Job: failed > backoffLimit; the operator: restarts >= backoffLimit)."""
    counted = 0
    for code in exits:
        result = outcome(code)
        if result == FAIL:
            return "Failed", counted
        if result == COUNT:
            counted += 1
            if limit is not None and (counted > limit if fails_above else counted >= limit):
                return "Failed", counted
    return "Running", counted


def _stop_code(c: dict) -> int:
    """The code the pod's launcher exits with after a checkpoint, with the container's environment."""
    from train.launch.command import requeue_exit_code

    return requeue_exit_code(dict(container_env(c, secrets={})))


def test_exit_codes_preemptions_never_use_up_the_retries_and_a_usage_error_ends_the_job():
    """A job preempted 50 times keeps running, with nothing counted; a usage error ends it on the first pod
    that says it; failures end the TrainJob after backoffLimit, and the PyTorchJob at once (its
    operator cannot count pods it replaces: docs/kubernetes.md says so)."""
    job, runtime, trainjob = _job(), _runtime(), _trainjob()
    pytorch = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    node = trainer_pod(trainjob, runtime)[1]
    pt = (lambda code: pytorchjob_outcome(job, code), None)  # no backoffLimit: ExitCode never reaches one
    tj = (lambda code: trainjob_outcome(runtime, code), _node_job(runtime).get("backoffLimit", 6))
    stop_pt, stop_tj = _stop_code(pytorch), _stop_code(node)
    assert stop_tj == 75, "the TrainJob's pods exit 75, which its runtime ignores"

    for (outcome, limit), stop in ((pt, stop_pt), (tj, stop_tj)):
        assert outcome(stop) == RESTART and job_state(outcome, [stop] * 50, limit) == ("Running", 0)
        assert job_state(outcome, [stop, stop, 2], limit) == ("Failed", 0)  # 2: the first one ends the job
    # Failures: counted towards the runtime's backoffLimit (its last one fails the Job, and the JobSet with
    # it), however many preemptions come in between.
    limit = tj[1]
    assert 1 <= limit <= 10
    assert job_state(tj[0], [1, stop_tj] * limit, limit) == ("Running", limit)
    assert job_state(tj[0], [1, stop_tj] * limit + [1], limit) == ("Failed", limit + 1)
    # A pod preempted, evicted or on a lost node is not the job's fault, whatever it exited with (137: the
    # grace period ran out); other codes count.
    assert trainjob_outcome(runtime, 137, disrupted=True) == RESTART and trainjob_outcome(runtime, 137) == COUNT
    # The PyTorchJob: the launcher's 1 fails the job (after torchrun's maxRestarts inside the pod); a pod
    # SIGKILLed (137) is replaced without counting, as ExitCode retries 128-255.
    assert pytorchjob_outcome(job, 1) == FAIL and pytorchjob_outcome(job, 137) == RESTART
    # Why the PyTorchJob's pods exit 143 and not 75: ExitCode fails the job on 1-127.
    assert pytorchjob_outcome(job, 75) == FAIL and stop_pt != 75


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
    MAX_FAILED_LAUNCHES such launches in a row end in 2, tests/test_hosts.py). Six launchers at once, none
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


def test_a_requeue_exit_code_that_means_something_else_is_a_usage_error(monkeypatch, capsys):
    """REQUEUE_EXIT_CODE 0, 1 or 2 would tell the scheduler done, failed or usage error after a healthy stop:
    the launcher refuses it at once, in one line, exit 2, before torchrun."""
    from train.launch import launcher as launch

    monkeypatch.setattr(launch.Signals, "install", lambda self: None)  # pytest's own signal handlers stay
    for value in ("0", "1", "2", "256", "x"):
        monkeypatch.setenv("REQUEUE_EXIT_CODE", value)
        assert launch.main(["--dry-run", "--config", "configs/default.yaml"]) == 2, value
        err = capsys.readouterr().err
        assert err.startswith("error: REQUEUE_EXIT_CODE must be an exit code from 3 to 255") and "torch" not in err
    monkeypatch.setenv("REQUEUE_EXIT_CODE", "143")
    assert launch.main(["--dry-run", "--config", "configs/default.yaml"]) == 0
