"""Offline schema checks for every manifest under infra/: what `kubectl apply --dry-run=server`
would reject, found without a cluster.

- Built-in kinds (ConfigMap, Secret, CronJob, RBAC, ...) against the Kubernetes OpenAPI schemas
  that `kubernetes-validate` bundles, strict (unknown fields are errors: the API server would
  drop them silently or, with strict field validation, refuse the object).
- KubeRay kinds (RayCluster, RayJob, RayCronJob) against `schemas/kuberay-v1.min.json`, whose
  pod templates resolve into those same Kubernetes definitions, so a typo inside a Ray pod's
  container spec fails exactly like one in a Deployment.
- The Ray cluster launcher YAML against Ray's own launcher schema (`validate_config` after
  `prepare_config`, the checks `ray up` runs first).

    python infra/validate.py        # validate everything, exit 1 on the first bad file
"""

from __future__ import annotations

import copy
import json
import re
import sys
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parent
REPO = INFRA.parent
K8S_DIR = INFRA / "k8s"
KUBERAY_SCHEMA = INFRA / "schemas" / "kuberay-v1.min.json"
LAUNCHER_YAMLS = sorted((INFRA / "ray").glob("*.yaml"))
# The oldest Kubernetes minor still in common managed offerings; manifests valid here are valid
# on newer ones (fields are only added). Override with validate(..., k8s_version=...).
K8S_VERSION = "1.31"
# Files in infra/k8s that are not Kubernetes objects (and harvest run configs, `run-*.yaml`).
NOT_OBJECTS = {"run.yaml", "kustomization.yaml"}


class ManifestError(ValueError):
    """A manifest that a cluster would refuse; the message names file, object and field path."""


def load_docs(path: Path) -> list[dict]:
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise ManifestError(f"{path}: not valid YAML: {e}") from None
    for d in docs:
        if not isinstance(d, dict):
            raise ManifestError(f"{path}: every YAML document must be a mapping, got {type(d)}")
    return docs


def object_manifests() -> list[Path]:
    """infra/k8s and its kustomization folders (schedule/, raycron/)."""
    return sorted(p for p in list(K8S_DIR.glob("*.yaml")) + list(K8S_DIR.glob("*/*.yaml"))
                  if p.name not in NOT_OBJECTS and not p.name.startswith("run-"))


def _where(doc: dict) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name') or meta.get('generateName') or '?'}"


def _path(err) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "<root>"


@lru_cache(maxsize=4)
def _k8s_definitions(version: str) -> dict:
    import kubernetes_validate.utils as kvu

    minor = kvu.major_minor(version)
    have = [v for v in kvu.all_versions() if kvu.major_minor(v) <= minor]
    if not have:
        raise ManifestError(f"kubernetes-validate has no schemas for Kubernetes {version}")
    ref = resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{have[-1]}-local-strict/_definitions.json")
    return json.loads(ref.read_text())


@lru_cache(maxsize=4)
def _kuberay_validator(version: str):
    import jsonschema
    from referencing import Registry, Resource

    schema = json.loads(KUBERAY_SCHEMA.read_text())
    registry = Registry().with_resources([
        (schema["$id"], Resource.from_contents(schema)),
        ("https://kubernetes.io/api/_definitions.json",
         Resource.from_contents(_k8s_definitions(version))),
    ])
    return schema, registry, jsonschema.Draft202012Validator


def validate_kuberay(doc: dict, k8s_version: str = K8S_VERSION) -> None:
    kind = doc.get("kind")
    schema, registry, cls = _kuberay_validator(k8s_version)
    if kind not in schema["$defs"] or kind[0].islower():
        raise ManifestError(f"{_where(doc)}: no KubeRay schema for kind {kind!r}")
    validator = cls({"$ref": f"{schema['$id']}#/$defs/{kind}"}, registry=registry)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        e = min(errors, key=lambda e: len(list(e.absolute_path)) * -1)  # the deepest is the cause
        raise ManifestError(f"{_where(doc)}: {_path(e)}: {e.message}")


def validate_builtin(doc: dict, k8s_version: str = K8S_VERSION) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise ManifestError(f"{_where(doc)}: {_path(e)}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise ManifestError(f"{_where(doc)}: {e.message}") from None


# The API server's resource.Quantity grammar (also the pattern in KubeRay's CRDs); the bundled
# OpenAPI schemas only say "integer or string", so "32G1" or "lots" would pass them.
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def check_quantities(doc: dict) -> None:
    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("limits", "requests") and path and path[-1] == "resources" \
                        and isinstance(v, dict):
                    for res, q in v.items():
                        if not QUANTITY.match(str(q)):
                            where = ".".join(map(str, path + [k, res]))
                            raise ManifestError(f"{_where(doc)}: {where}: {q!r} is not a "
                                                "Kubernetes quantity (e.g. 8, 500m, 32Gi)")
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    walk(doc, [])


def validate_doc(doc: dict, k8s_version: str = K8S_VERSION) -> None:
    for key in ("apiVersion", "kind", "metadata"):
        if key not in doc:
            raise ManifestError(f"{_where(doc)}: missing top-level field {key!r}")
    if str(doc["apiVersion"]).startswith("ray.io/"):
        validate_kuberay(doc, k8s_version)
    else:
        validate_builtin(doc, k8s_version)
    check_quantities(doc)


def validate_launcher(path: Path) -> dict:
    """Ray's own launcher checks; returns the config with Ray's defaults filled in."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load_docs(path)
    if len(raw) != 1:
        raise ManifestError(f"{path}: a launcher config is one YAML document")
    try:
        filled = prepare_config(copy.deepcopy(raw[0]))
        validate_config(filled)
    except Exception as e:  # jsonschema.ValidationError, ValueError from Ray's checks
        raise ManifestError(f"{path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return filled


def validate_all(k8s_version: str = K8S_VERSION) -> list[str]:
    done = []
    for path in object_manifests():
        for doc in load_docs(path):
            try:
                validate_doc(doc, k8s_version)
            except ManifestError as e:
                raise ManifestError(f"{path.relative_to(REPO)}: {e}") from None
            done.append(f"{path.relative_to(REPO)}: {_where(doc)}")
    for path in LAUNCHER_YAMLS:
        validate_launcher(path)
        done.append(f"{path.relative_to(REPO)}: ray cluster launcher config")
    return done


def main() -> int:
    try:
        for line in validate_all():
            print("ok  " + line)
    except ManifestError as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
