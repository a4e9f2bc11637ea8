"""Strict schema validation of rendered manifests, offline.

Core kinds are validated against the Kubernetes OpenAPI-derived JSON schemas that the PyPI package
`kubernetes-validate` ships (no network). LeaderWorkerSet is a CRD with no schema there: its pod templates are
validated as core/v1 PodTemplateSpec, the rest by `_check_lws_structure` (field names and enums of
leaderworkerset.x-k8s.io/v1).
"""

from __future__ import annotations

from typing import Any

from echo_vllm.manifests.checks import LWS_API, Resource, _name

DEFAULT_K8S_VERSION = "1.33"  # the schemas kubernetes-validate checks against unless --k8s-version says otherwise

_LWS_SPEC_KEYS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
_LWT_KEYS = {
    "leaderTemplate",
    "workerTemplate",
    "size",
    "restartPolicy",
    "subGroupPolicy",
    "volumeClaimTemplates",
    "persistentVolumeClaimRetentionPolicy",
}
_LWS_ENUMS = {
    ("spec", "startupPolicy"): {"LeaderCreated", "LeaderReady"},
    ("spec", "leaderWorkerTemplate", "restartPolicy"): {
        "Default",
        "RecreateGroupOnPodRestart",
        "RecreateGroupAfterStart",
        "None",
    },
}


def _check_lws_structure(lws: Resource) -> list[str]:
    where = f"LeaderWorkerSet/{_name(lws)}"
    problems = []
    if lws.get("apiVersion") != LWS_API:
        problems.append(f"{where}: apiVersion must be {LWS_API}")
    spec = lws.get("spec")
    if not isinstance(spec, dict):
        return [*problems, f"{where}: spec missing"]
    problems += [f"{where}: spec.{k}: unknown field" for k in sorted(set(spec) - _LWS_SPEC_KEYS)]
    lwt = spec.get("leaderWorkerTemplate")
    if not isinstance(lwt, dict) or "workerTemplate" not in lwt:
        return [*problems, f"{where}: spec.leaderWorkerTemplate.workerTemplate is required"]
    problems += [f"{where}: spec.leaderWorkerTemplate.{k}: unknown field" for k in sorted(set(lwt) - _LWT_KEYS)]
    for key, minimum in ((("spec", "replicas"), 0), (("spec", "leaderWorkerTemplate", "size"), 1)):
        node: Any = lws
        for part in key:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < minimum):
            problems.append(f"{where}: {'.'.join(key)} must be an integer >= {minimum}, got {node!r}")
    for key, allowed in _LWS_ENUMS.items():
        node = lws
        for part in key:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and node not in allowed:
            problems.append(f"{where}: {'.'.join(key)} {node!r} not one of {sorted(allowed)}")
    return problems


def validate_schemas(resources: list[Resource], k8s_version: str = DEFAULT_K8S_VERSION) -> list[str]:
    """Strict JSON-schema validation of every resource (kubernetes-validate's bundled schemas, offline)."""
    import kubernetes_validate

    def one(obj: Resource, label: str) -> list[str]:
        try:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path) if hasattr(err, "path") else ""
            return [f"{label}: {path}: {err.message}" if path else f"{label}: {err.message}"]
        except kubernetes_validate.SchemaNotFoundError:
            return [f"{label}: no schema for {obj.get('apiVersion')}/{obj.get('kind')} in Kubernetes {k8s_version}"]
        return []

    problems = []
    for res in resources:
        label = f"{res.get('kind')}/{_name(res)}"
        if res.get("kind") == "LeaderWorkerSet":
            problems += _check_lws_structure(res)
            lwt = (res.get("spec") or {}).get("leaderWorkerTemplate") or {}
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    wrapped = {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{_name(res)}-{key}"},
                        "template": lwt[key],
                    }
                    problems += one(wrapped, f"{label} {key} (as core/v1 PodTemplateSpec)")
        else:
            problems += one(res, label)
    return problems
