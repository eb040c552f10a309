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
CRD = ROOT.parent / "shared" / "schemas" / "kubeflow.org_pytorchjobs.yaml"
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def _objects() -> list[tuple[Path, dict]]:
    """What `kubectl apply -f k8s` applies: every document of every YAML/JSON file at the top of k8s/."""
    out = []
    for path in sorted(K8S.iterdir()):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
            out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def _find(kind: str, name: str | None = None) -> dict:
    found = [doc for _, doc in _objects() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in k8s/, found {len(found)}"
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
    assert worker["restartPolicy"] == "OnFailure"
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


def replica_nodes(job: dict, tmp: Path, real_hosts: bool = False) -> tuple[list[Node], dict[str, Path]]:
    """Each replica of the job as a process: its command, its container env + the operator's env, its
    volumes as folders (ConfigMaps written out, one folder per PVC shared by all pods). On real hosts (one
    per pod, named as its pod) the Services' names and ports are used as they are; otherwise each name
    is mapped to 127.0.0.1 and a free port per pod."""
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
        pod_dir = tmp / f"{rt.lower()}-{i}"
        c = _container(replica)
        volumes = {v["name"]: v for v in replica["template"]["spec"].get("volumes", [])}
        mounts = {}
        for m in c.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                _find("PersistentVolumeClaim", claim)
                folder = claims.setdefault(claim, tmp / "pvc" / claim)
            elif "configMap" in v:
                folder = pod_dir / "volumes" / m["name"]
                folder.mkdir(parents=True, exist_ok=True)
                for key, text in _find("ConfigMap", v["configMap"]["name"])["data"].items():
                    (folder / key).write_text(text)
            elif "emptyDir" in v:
                folder = pod_dir / "volumes" / m["name"]
            else:
                raise AssertionError(f"unsupported volume {v}")
            if m["mountPath"] != "/dev/shm":  # the host's /dev/shm stands in for the memory emptyDir
                mounts[m["mountPath"]] = folder
            folder.mkdir(parents=True, exist_ok=True)
        env = dict(container_env(c, secrets={}))
        env.update(operator_env(job, rt, i, address))  # appended after the container's: it wins
        argv = local_argv([map_paths(a, mounts) for a in pod_argv(c)])
        nodes.append(Node(f"{rt.lower()}-{i}", tiny(argv), clean_env(**env), tmp / f"{rt.lower()}-{i}.log"))
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
    expected = {"PET_NNODES", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_MAX_RESTARTS",
                "PET_NPROC_PER_NODE", "PYTHONUNBUFFERED"}
    if variant != "as written":
        expected |= {"MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE", "RANK",
                     "PET_NODE_RANK"}
    for node in nodes:
        assert expected <= node.env.keys(), expected - node.env.keys()
        assert node.env["PET_NNODES"] == f"{policy['minReplicas']}:{policy['maxReplicas']}"
        print(f"{node.name}: " + " ".join(f"{k}={node.env[k]}" for k in sorted(expected)) + f" {quoted(node.argv)}")
    if variant != "as written":
        assert [n.env["RANK"] for n in nodes] == ["0", "1"] and {n.env["WORLD_SIZE"] for n in nodes} == {"2"}
    results = run_nodes(nodes, hosts=hosts, stagger=5)
    if variant == "as written":  # worker-1 started 5 s before worker-0's name resolved: it waited, then trained
        assert "for the rendezvous host: ddp-template-worker-0 does not resolve yet" in results["worker-1"][1]
    for name, (code, log) in results.items():
        assert code == 0, f"{name} exited {code}\n{log[-4000:]}"
        assert f"--nnodes={policy['minReplicas']}:{policy['maxReplicas']}" in log  # the launcher used PET_*
        assert f"--rdzv-endpoint={nodes[0 if variant == 'as written' else 1].env['PET_RDZV_ENDPOINT']}" in log
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    s = summary(claims["ddp-template-runs"] / Path(run_dir).relative_to("/runs"))
    assert s["world_size"] == 2 and s["steps"] == 6 and s["ranks_in_sync"], s


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
    assert "torch.distributed.run" not in proc.stderr, "torchrun started"
    assert not any(claim.iterdir())


def test_a_file_where_the_run_directory_should_be_is_one_line(tmp_path):
    """python -m train itself (no launcher) makes the run directory where it creates it (train/log.py):
    a file in its place, which fails for any user."""
    (tmp_path / "runs").write_text("not a folder\n")
    run_dir = tmp_path / "runs" / "x"
    from tests.conftest import TINY

    proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", *TINY, f"run.dir={run_dir}"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    _one_line_hint(proc, str(run_dir))
