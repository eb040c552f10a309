"""k8s/: every manifest validated against its schema and the operators' conventions."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.multinode import required
from train import config

K8S = ROOT / "k8s"


TRAINJOB_DIR = K8S / "trainjob"  # kubectl apply -f k8s/trainjob: its own job, never with k8s/'s


# The 2 nodes x 8 GPUs variants, each `kubectl apply -f`'d alone: subfolders, which the commands above do not read.
PYTORCHJOB_8 = K8S / "2x8gpu"
TRAINJOB_8 = TRAINJOB_DIR / "2x8gpu"
PYTORCHJOBS = [K8S, PYTORCHJOB_8]
TRAINJOBS = [TRAINJOB_DIR, TRAINJOB_8]


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


def _job(folder: Path = K8S) -> dict:
    return _find("PyTorchJob", folder=folder)


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


@pytest.mark.parametrize("folder", PYTORCHJOBS + TRAINJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_core_objects_validate_with_kubernetes_validate(folder):
    kv = _kubernetes_validate()
    version = kv.latest_version()
    checked = 0
    for path, doc in _objects(folder):
        if doc["kind"] in ("TrainJob", "TrainingRuntime"):  # their CRDs: test_trainjob_validates_*
            continue
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
    assert checked >= 2  # the ConfigMap and the PVC, and the PyTorchJob's pod template


@pytest.mark.parametrize("folder", PYTORCHJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_pytorchjob_validates_against_the_operators_crd(folder):
    import jsonschema

    schema = _strict(_crd_schema())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_job(folder)), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    # And the check bites: a misplaced field is refused.
    bad = copy.deepcopy(_job(folder))
    bad["spec"]["elasticPolicy"]["nprocPerNode"] = 1
    assert list(validator.iter_errors(bad))


@pytest.mark.parametrize("folder", PYTORCHJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_pytorchjob_conventions(folder):
    job = _job(folder)
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
    assert "ReadWriteMany" in _find("PersistentVolumeClaim", claim, folder)["spec"]["accessModes"]
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    assert run_dir.startswith("/runs/"), "runs and checkpoints on the PVC, so a restarted pod resumes"
    config_path = Path(c["args"][c["args"].index("--config") + 1])
    config_map = next(v["configMap"]["name"] for p, v in mounts.items()
                      if "configMap" in v and config_path.is_relative_to(p))
    assert config_path.name in _find("ConfigMap", config_map, folder)["data"]

    wandb = next(e for e in c["env"] if e["name"] == "WANDB_API_KEY")["valueFrom"]["secretKeyRef"]
    assert wandb["optional"] is True
    assert not any("value" in e and re.search(r"KEY|TOKEN|PASSWORD|SECRET", e["name"]) for e in c["env"])

    pod_sc, sc = pod["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] and sc["runAsNonRoot"] and pod_sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert pod_sc["seccompProfile"]["type"] == sc["seccompProfile"]["type"] == "RuntimeDefault"


@pytest.mark.parametrize("folder", PYTORCHJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_configmap_config_is_valid_at_every_allowed_size(tmp_path, folder):
    """The ConfigMap's config with the job's overrides loads, and its batch arithmetic holds for every world
    size the elastic job may run at (minReplicas..maxReplicas nodes)."""
    job = _job(folder)
    c = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    path = tmp_path / "train.yaml"
    path.write_text(_find("ConfigMap", "ddp-template-config", folder)["data"]["train.yaml"])
    cfg = config.load(str(path), c["args"][c["args"].index("--config") + 2:])
    policy = job["spec"]["elasticPolicy"]
    for nodes in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        config.validate(cfg, nodes * int(job["spec"]["nprocPerNode"]))
    # A membership change (a pod joins or leaves) gives the workers torch's fixed 30 s to save, whatever
    # STOP_TIMEOUT says: the periodic checkpoints bound what a save that does not fit loses.
    assert 0 < cfg.checkpoint.every <= cfg.train.steps // 2, cfg.checkpoint


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


# Every `image:` of the manifests, by where it is (docs/kubernetes.md, "Your own task", names each): an image of
# the user's goes into all of them. The TrainJob has two, its own (which wins) and its runtime's container's.
_PT_IMAGE = ["spec.pytorchReplicaSpecs.Worker.template.spec.containers[pytorch].image"]
_RUNTIME_IMAGE = ["spec.template.spec.replicatedJobs[node].template.spec.template.spec.containers[node].image"]
IMAGE_FIELDS = {
    "k8s/pytorchjob.yaml": _PT_IMAGE,
    "k8s/trainjob/trainjob.yaml": ["spec.trainer.image"],
    "k8s/trainjob/runtime.yaml": _RUNTIME_IMAGE,
    "k8s/2x8gpu/pytorchjob.yaml": _PT_IMAGE,
    "k8s/trainjob/2x8gpu/trainjob.yaml": ["spec.trainer.image"],
    "k8s/trainjob/2x8gpu/runtime.yaml": _RUNTIME_IMAGE,
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
    found = {str(path.relative_to(ROOT)): [] for folder in PYTORCHJOBS + TRAINJOBS for path, _ in _objects(folder)}
    for folder in PYTORCHJOBS + TRAINJOBS:
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


TORCH_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


TRAINER_PORT = 29500  # pkg/constants: ContainerTrainerPort, PET_MASTER_PORT


def _trainjob(folder: Path = TRAINJOB_DIR) -> dict:
    return _find("TrainJob", folder=folder)


def _v2(name: str) -> dict:
    path = TRAINER_V2 / name
    if not path.exists():
        required(str(path), "Kubeflow Trainer v2's CRDs and runtime are not beside this checkout")
    return yaml.safe_load(path.read_text())


def _runtime(folder: Path = TRAINJOB_DIR) -> dict:
    """The runtime the TrainJob names: its own TrainingRuntime, shipped beside it (k8s/trainjob/), or a
    ClusterTrainingRuntime as the trainer installs it (torch-distributed)."""
    ref = _trainjob(folder)["spec"]["runtimeRef"]
    assert ref.get("apiGroup", "trainer.kubeflow.org") == "trainer.kubeflow.org"
    if ref.get("kind", "ClusterTrainingRuntime") == "TrainingRuntime":  # namespaced: applied with the TrainJob
        return _find("TrainingRuntime", ref["name"], folder)
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


def test_kubectl_apply_k8s_creates_exactly_one_job_and_k8s_trainjob_the_other():
    jobs = {"PyTorchJob", "TrainJob"}
    assert [doc["kind"] for _, doc in _objects() if doc["kind"] in jobs] == ["PyTorchJob"]
    assert [doc["kind"] for _, doc in _objects(TRAINJOB_DIR) if doc["kind"] in jobs] == ["TrainJob"]
    for path, doc in _objects(TRAINJOB_DIR):
        assert "namespace" not in doc["metadata"], f"{path}: kubectl apply -n NAMESPACE chooses it"
        if doc["kind"] in ("ConfigMap", "PersistentVolumeClaim"):  # the same objects: applying both is a no-op
            assert doc == _find(doc["kind"], doc["metadata"]["name"]), f"{path} differs from k8s/'s"
    assert not [p for p in TRAINJOB_DIR.iterdir()
                if p != TRAINJOB_8 and (p.is_dir() or p.suffix not in (".yaml", ".yml"))]


@pytest.mark.parametrize("folder", TRAINJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_trainjob_validates_against_the_trainers_crds_and_webhook(folder):
    job, runtime = _trainjob(folder), _runtime(folder)
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


@pytest.mark.parametrize("folder", TRAINJOBS, ids=lambda f: str(f.relative_to(ROOT)))
def test_trainjob_pod_validates_and_follows_the_conventions(tmp_path, folder):
    kv = _kubernetes_validate()
    job, runtime = _trainjob(folder), _runtime(folder)
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
    assert "ReadWriteMany" in _find("PersistentVolumeClaim", claim, folder)["spec"]["accessModes"]
    run_dir = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("run.dir="))
    assert run_dir.startswith("/runs/")  # its own: test_every_job_has_its_own_name_run_directory_and_rendezvous
    pod_sc, sc = pod["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] and sc["runAsNonRoot"] and pod_sc["runAsUser"] == 10001
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The config loads with the job's overrides and its batch arithmetic holds for the job's world size.
    path = tmp_path / "train.yaml"
    path.write_text(_find("ConfigMap", "ddp-template-config", folder)["data"]["train.yaml"])
    cfg = config.load(str(path), c["args"][c["args"].index("--config") + 2:])
    config.validate(cfg, trainer["numNodes"] * trainer["numProcPerNode"])


@pytest.mark.parametrize("variant", ["1 GPU", "2x8gpu"])
def test_grace_period_is_the_stop_budget_plus_the_launchers_margin_in_each_manifest(variant):
    """terminationGracePeriodSeconds (when the kubelet SIGKILLs) = STOP_TIMEOUT (the seconds torchrun gives
    the workers to save) + train/launch/command.py's GRACE_MARGIN_S (torchrun's and the launcher's own exit): one
    stop budget, so raising one without the other fails here. The TrainJob's pod is built as the trainer
    builds it (its runtime's pod and env, the TrainJob's env over it)."""
    from train.launch.command import GRACE_MARGIN_S

    pt, tj = (K8S, TRAINJOB_DIR) if variant == "1 GPU" else (PYTORCHJOB_8, TRAINJOB_8)
    worker = _job(pt)["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod, c = trainer_pod(_trainjob(tj), _runtime(tj))
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
            (TRAINJOB_DIR / "trainjob.yaml", _trainjob(), _crd_validator("trainer.kubeflow.org_trainjobs.yaml")),
            (PYTORCHJOB_8 / "pytorchjob.yaml", _job(PYTORCHJOB_8), jsonschema.Draft7Validator(_strict(_crd_schema()))),
            (TRAINJOB_8 / "trainjob.yaml", _trainjob(TRAINJOB_8),
             _crd_validator("trainer.kubeflow.org_trainjobs.yaml"))):
        queue, labelled = _kueue_option(path)
        assert labelled["metadata"]["labels"].pop("kueue.x-k8s.io/queue-name") == queue
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", queue), queue
        assert labelled == job, f"{path}: the label is the only change"
        labelled["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = queue
        assert not list(validator.iter_errors(labelled)), path
        assert "suspend" not in str(job["spec"].get("runPolicy", {})) and "suspend" not in job["spec"], \
            f"{path}: Kueue suspends it; without Kueue it starts at once"


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


# ---------------------------------------------------------------- sized per GPU; the 2 nodes x 8 GPUs variants

def _quantity(q) -> float:
    """A Kubernetes quantity (10, "500m", "96Gi") as a number: CPUs, bytes."""
    m = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti)?", str(q))
    assert m, q
    return float(m[1]) * {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m[2]]


def _sizes() -> dict[str, tuple[int, dict, dict]]:
    """(GPUs, resources, the /dev/shm emptyDir) of each job's pod, by its folder."""
    out = {}
    for folder in PYTORCHJOBS:
        job = _job(folder)
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        c, pod = _container(worker), worker["template"]["spec"]
        out[str(folder.relative_to(ROOT))] = (int(job["spec"]["nprocPerNode"]), c["resources"], pod)
    for folder in TRAINJOBS:
        job = _trainjob(folder)
        pod, c = trainer_pod(job, _runtime(folder))
        out[str(folder.relative_to(ROOT))] = (int(job["spec"]["trainer"]["numProcPerNode"]), c["resources"], pod)
    for name, (gpus, resources, pod) in out.items():
        mount = next(m["name"] for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        out[name] = (gpus, resources, next(v for v in pod["volumes"] if v["name"] == mount)["emptyDir"])
    return out


def test_every_pod_is_sized_per_gpu_with_requests_equal_to_limits():
    """CPU, memory and /dev/shm scale with the GPUs a pod holds, at one share per GPU in every manifest: a pod of
    8 ranks in a 1-GPU pod's memory is the OOM kill (137) the operator recreates for ever. Requests = limits
    (Guaranteed QoS); /dev/shm is memory, inside the limit, with room for the ranks beside it."""
    shares = {}
    for name, (gpus, resources, shm) in _sizes().items():
        requests, limits = resources["requests"], resources["limits"]
        assert str(limits["nvidia.com/gpu"]) == str(gpus), name
        assert {k: _quantity(requests[k]) for k in ("cpu", "memory")} == \
               {k: _quantity(limits[k]) for k in ("cpu", "memory")}, f"{name}: requests = limits (Guaranteed)"
        assert shm["medium"] == "Memory" and _quantity(shm["sizeLimit"]) <= _quantity(limits["memory"]) / 4, name
        shares[name] = (_quantity(limits["cpu"]) / gpus, _quantity(limits["memory"]) / gpus / 2**30,
                        _quantity(shm["sizeLimit"]) / gpus / 2**30)
    assert len(set(shares.values())) == 1, f"one share per GPU (CPUs, memory GiB, /dev/shm GiB): {shares}"
    cpu, memory, shm = next(iter(shares.values()))
    assert 8 <= cpu <= 12 and 64 <= memory <= 128 and 8 <= shm, shares  # k8s/pytorchjob.yaml says why
    assert memory * 8 < 1024, "8 GPUs' share fits a 1 TiB node, with room for its kubelet and daemons"


def test_the_2x8gpu_variants_are_two_nodes_of_eight_at_a_fixed_size():
    job, trainjob = _job(PYTORCHJOB_8), _trainjob(TRAINJOB_8)
    policy, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert job["spec"]["nprocPerNode"] == "8" and trainjob["spec"]["trainer"]["numProcPerNode"] == 8
    assert policy["minReplicas"] == policy["maxReplicas"] == worker["replicas"] == 2, "fixed: 2 nodes or none"
    assert trainjob["spec"]["trainer"]["numNodes"] == 2


def _without(doc: dict, *paths: str) -> dict:
    """The object with these dotted paths (list items by name) removed."""
    doc = copy.deepcopy(doc)
    for path in paths:
        node, keys = doc, path.split(".")
        for key in keys[:-1]:
            node = next(x for x in node if x.get("name") == key) if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[:] = [x for x in node if x.get("name") != keys[-1]]
        else:
            node.pop(keys[-1])
    return doc


def test_the_2x8gpu_variants_are_the_1_gpu_jobs_but_for_their_size_and_name():
    """Security, exit codes, stop budget, volumes: the variants' are the defaults' (a fix to one reaches both)."""
    pt_size = ("metadata.name", "spec.elasticPolicy.rdzvId", "spec.elasticPolicy.minReplicas",
               "spec.nprocPerNode", "spec.pytorchReplicaSpecs.Worker.template.spec.containers.pytorch.resources",
               "spec.pytorchReplicaSpecs.Worker.template.spec.containers.pytorch.args",
               "spec.pytorchReplicaSpecs.Worker.template.spec.volumes.dshm")
    assert _without(_job(PYTORCHJOB_8), *pt_size) == _without(_job(), *pt_size)
    tj_size = ("metadata.name", "spec.runtimeRef.name", "spec.trainer.numProcPerNode", "spec.trainer.resourcesPerNode",
               "spec.trainer.args", "spec.trainer.env.RDZV_ID")
    assert _without(_trainjob(TRAINJOB_8), *tj_size) == _without(_trainjob(), *tj_size)
    rt_size = ("metadata.name", "spec.template.spec.replicatedJobs.node.template.spec.template.spec.volumes.dshm")
    assert _without(_runtime(TRAINJOB_8), *rt_size) == _without(_runtime(), *rt_size)
    for folder, default in ((PYTORCHJOB_8, K8S), (TRAINJOB_8, TRAINJOB_DIR)):
        for kind in ("ConfigMap", "PersistentVolumeClaim"):  # the same objects: applying both folders is a no-op
            assert _find(kind, folder=folder) == _find(kind, folder=default), (folder, kind)
        assert not [p for p in folder.iterdir() if p.is_dir() or p.suffix not in (".yaml", ".yml")], folder


def test_every_job_has_its_own_name_run_directory_and_rendezvous():
    """All four may run in one namespace at once: no two share a name, a run directory or a rendezvous id."""
    names, run_dirs, rdzv = [], [], []  # (kind, name); run.dir; (kind, rendezvous id)
    for folder in PYTORCHJOBS:
        job = _job(folder)
        args = _container(job["spec"]["pytorchReplicaSpecs"]["Worker"])["args"]
        names.append(("PyTorchJob", job["metadata"]["name"]))
        run_dirs += [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]
        rdzv.append(("PyTorchJob", job["spec"]["elasticPolicy"]["rdzvId"]))
    for folder in TRAINJOBS:
        job, runtime = _trainjob(folder), _runtime(folder)
        names += [("TrainJob", job["metadata"]["name"]), ("TrainingRuntime", runtime["metadata"]["name"])]
        run_dirs += [a.split("=", 1)[1] for a in job["spec"]["trainer"]["args"] if a.startswith("run.dir=")]
        rdzv.append(("TrainJob", next(e["value"] for e in job["spec"]["trainer"]["env"] if e["name"] == "RDZV_ID")))
    assert len(run_dirs) == 4 and len(set(run_dirs)) == 4, run_dirs
    assert len(names) == 6 and len(set(names)) == 6 and len(set(rdzv)) == 4, (names, rdzv)


# ---------------------------------------------------------------- the pods' names and labels, as the operators set them

# Kubeflow training operator v1.9 (github.com/kubeflow/training-operator, tag v1.9.0):
# pkg/apis/kubeflow.org/v1/common_types.go (the label keys); pkg/controller.v1/common/job_controller.go, GenLabels
# (operator-name, job-name); pkg/controller.v1/common/pod.go, ReconcilePods (rt = strings.ToLower(rtype)) and
# createNewPod (replica-type, replica-index, job-role=master; the pod's name: pkg/controller.v1/common/util.go,
# GenGeneralName, <job>-<rt>-<index>); pkg/controller.v1/pytorch/pytorchjob_controller.go (controllerName).
PT_OPERATOR_NAME = ("training.kubeflow.org/operator-name", "pytorchjob-controller")
PT_JOB_NAME = "training.kubeflow.org/job-name"
PT_REPLICA_TYPE = "training.kubeflow.org/replica-type"
PT_REPLICA_INDEX = "training.kubeflow.org/replica-index"
PT_JOB_ROLE = "training.kubeflow.org/job-role"
# Kubeflow Trainer v2.3 (github.com/kubeflow/trainer, tag v2.3.0): pkg/runtime/framework/plugins/jobset/jobset.go
# builds a JobSet named as the TrainJob (jobsetv1alpha2ac.JobSet(trainJob.Name, ...)); its go.mod pins JobSet v0.12.0.
# JobSet v0.12.0 (github.com/kubernetes-sigs/jobset): pkg/util/placement/placement.go, GenJobName
# (<jobset>-<replicatedjob>-<job index>); pkg/controllers/jobset_controller.go, constructJob and
# labelAndAnnotateObject (on the Job and on its pod template) with the keys of api/jobset/v1alpha2/jobset_types.go;
# pkg/webhooks/jobset_webhook.go defaults completionMode to Indexed.
JS_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JS_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JS_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
# Kubernetes (github.com/kubernetes/kubernetes) pkg/controller/job/indexed_job_utils.go: addCompletionIndexLabel (the
# PodIndexLabel gate, on by default since 1.28) and podGenerateNameWithIndex: an Indexed Job's pod is named
# <job>-<index>-<random>, its hostname <job>-<index>.
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def pytorchjob_pods(job: dict) -> dict[str, dict[str, str]]:
    """{pod name: its labels} of a PyTorchJob's pods, as the operator creates them."""
    name, out = job["metadata"]["name"], {}
    for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
        for i in range(replica.get("replicas", 1)):
            labels = dict(replica["template"].get("metadata", {}).get("labels", {}))
            labels.update({PT_OPERATOR_NAME[0]: PT_OPERATOR_NAME[1], PT_JOB_NAME: name,
                           PT_REPLICA_TYPE: rtype.lower(), PT_REPLICA_INDEX: str(i)})
            if rtype == "Master":
                labels[PT_JOB_ROLE] = "master"
            out[f"{name}-{rtype.lower()}-{i}"] = labels
    return out


def trainjob_pods(job: dict, runtime: dict) -> dict[str, dict[str, str]]:
    """{pod hostname: its labels} of a TrainJob's node pods, as the trainer, JobSet and the Job controller make
    them (the pod's name is its hostname and a random suffix)."""
    name, rjob = job["metadata"]["name"], "node"
    nodes = job["spec"]["trainer"].get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    template = _node_job(runtime)["template"]
    out = {}
    for i in range(nodes):
        labels = dict(template.get("metadata", {}).get("labels", {}))
        labels.update({JS_JOBSET_NAME: name, JS_REPLICATED_JOB: rjob, JS_JOB_INDEX: "0", JOB_COMPLETION_INDEX: str(i)})
        out[f"{name}-{rjob}-0-{i}"] = labels
    return out


def _page_kubectl(verb: str) -> list[list[str]]:
    """The words of each `kubectl VERB` of docs/kubernetes.md's bash blocks (a pipe's first part, its comment cut)."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    lines = [re.split(r"\s+#\s", line)[0].split(" | ")[0].split()
             for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [words for words in lines if words[:2] == ["kubectl", verb]]


def test_the_pages_label_selectors_select_the_pods_the_operators_make():
    """Each `-l` of docs/kubernetes.md selects pods of its job by the labels the operator's source sets: a whole
    job's pods, or (an index of 0) the one pod that hosts the rendezvous; and no `kubectl logs` names a pod by a
    name it does not have (a TrainJob's pods end in a random suffix)."""
    pt, trainjob = _job(), _trainjob()
    pods = {"PyTorchJob": pytorchjob_pods(pt), "TrainJob": trainjob_pods(trainjob, _runtime())}
    rendezvous = {"PyTorchJob": f"{pt['metadata']['name']}-worker-0",  # PET_RDZV_ENDPOINT: worker-0's Service
                  "TrainJob": trainer_master_addr(trainjob).split(".")[0]}  # PET_MASTER_ADDR: <hostname>.<subdomain>
    selectors = [words[words.index("-l") + 1] for verb in ("logs", "get") for words in _page_kubectl(verb)
                 if "-l" in words]
    assert len(selectors) >= 6, selectors
    seen = set()
    for selector in selectors:
        wanted = dict(term.split("=", 1) for term in selector.split(","))
        kind = "PyTorchJob" if PT_JOB_NAME in wanted else "TrainJob"
        chosen = sorted(pod for pod, labels in pods[kind].items() if wanted.items() <= labels.items())
        if "0" in (wanted.get(PT_REPLICA_INDEX), wanted.get(JOB_COMPLETION_INDEX)):
            assert chosen == [rendezvous[kind]], (selector, chosen)
        else:
            assert chosen == sorted(pods[kind]) and len(chosen) == 2, (selector, chosen)
        seen.add(kind)
    assert seen == {"PyTorchJob", "TrainJob"}
    for words in _page_kubectl("logs"):
        named = [w for w in words[2:] if not w.startswith("-") and "=" not in w and w != "|"][:1]
        assert not named or named[0] in pods["PyTorchJob"], f"no pod is named {named[0]}: {' '.join(words)}"


def trainer_master_addr(job: dict) -> str:
    """PET_MASTER_ADDR as the trainer's torch plugin sets it (pkg/runtime/framework/plugins/torch/torch.go)."""
    return f"{job['metadata']['name']}-node-0-0.{job['metadata']['name']}"
