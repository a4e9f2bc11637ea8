"""Checks for deploy/'s rendered manifests: do their numbers, commands, mounts and echo.json agree?

Used by tests/test_deploy.py and `echo-vllm deploy check` (echo_vllm.manifests.cli). Input is the list of
resources `echo_vllm.manifests.render.render` returns; output a list of problems, empty when consistent.
The echo.json inside a ConfigMap is checked by the plugin's own validator (`echo_vllm.vllm.spec`, no vLLM
import) without looking at files, which live on the cluster's volumes.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from echo_vllm.vllm.combinations import engine_findings
from echo_vllm.vllm.spec import is_echo_request, spec_problems

GPU = "nvidia.com/gpu"
LWS_API = "leaderworkerset.x-k8s.io/v1"
ANN_NODES = "echo-vllm/nodes"
ANN_GPUS_PER_NODE = "echo-vllm/gpus-per-node"
# The kinds deploy/ may contain; anything else is reported, not silently passed.
CORE_KINDS = {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"}
WORKLOAD_KINDS = {"Deployment", "LeaderWorkerSet"}

Resource = dict[str, Any]


# ------------------------------------------------------------------------------------- speculative config


def check_speculative_config(data: Any, where: str = "echo.json") -> list[str]:
    """Problems with an echo.json object (what `--speculative-config` gets), as `vllm serve` would find them
    except for the files: the head must be a path, but it and the calibration file are on the cluster."""
    _, problems = spec_problems(data, check_files=False)
    return [f"{where}: {p}" for p in problems]


def _check_engine_combinations(data: Any, serve: dict, where: str) -> list[str]:
    """The plugin's refusals that depend on the serve flags (vllm/combinations.py), e.g. ECHO with pipeline
    parallelism: the same rules `vllm serve` applies at engine config, so a manifest fails here first."""
    if not (isinstance(data, dict) and is_echo_request(data)):
        return []
    flags = SimpleNamespace(tensor_parallel_size=serve.get("tp"), pipeline_parallel_size=serve.get("pp"))
    refusals, _warnings = engine_findings(data, flags)
    return [f"{where}: {r}" for r in refusals]


# ------------------------------------------------------------------------------------------ small helpers


def _by_kind(resources: Iterable[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r.get("kind") == kind]


def _name(resource: Resource) -> str:
    return resource.get("metadata", {}).get("name", "?")


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _gpus(container: dict) -> tuple[int, int]:
    res = container.get("resources") or {}
    return _int((res.get("requests") or {}).get(GPU, 0)) or 0, _int((res.get("limits") or {}).get(GPU, 0)) or 0


def _pod_gpus(pod_spec: dict) -> int:
    return sum(_gpus(c)[1] for c in pod_spec.get("containers", []))


_SEPARATORS = {"&&", "||", ";", "|", "&"}


def command_segments(container: dict) -> list[list[str]]:
    """The container's command line(s) as token lists. No `command` means the image entrypoint, `vllm serve`.
    A `bash -c SCRIPT` is split into its `&&`/`;` separated commands."""
    command = list(container.get("command") or [])
    args = [str(a) for a in container.get("args") or []]
    if not command:
        return [["vllm", "serve", *args]]
    if Path(command[0]).name in ("bash", "sh") and len(command) >= 2 and command[1] == "-c":
        script = " ".join([*command[2:], *args])
        lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segments: list[list[str]] = [[]]
        for token in lexer:
            if token in _SEPARATORS:
                segments.append([])
            else:
                segments[-1].append(token)
        return [s for s in segments if s]
    return [[*command, *args]]


def _strip_exec(tokens: list[str]) -> list[str]:
    return tokens[1:] if tokens and tokens[0] == "exec" else tokens


def find_serve(container: dict) -> dict | None:
    """Parse the `vllm serve` (or deploy/ray/serve.sh) invocation of a container, or None if it has none."""
    for tokens in command_segments(container):
        tokens = _strip_exec(tokens)
        rest = None
        via_serve_sh = False
        for i, tok in enumerate(tokens):
            if Path(tok).name == "vllm" and i + 1 < len(tokens) and tokens[i + 1] == "serve":
                rest = tokens[i + 2 :]
                break
            if Path(tok).name == "serve.sh":
                rest, via_serve_sh = tokens[i + 1 :], True
                break
        if rest is None:
            continue
        flags: dict[str, str] = {}
        positional: list[str] = []
        i = 0
        while i < len(rest):
            tok = rest[i]
            if tok.startswith("--"):
                if "=" in tok:
                    key, value = tok[2:].split("=", 1)
                    flags[key] = value
                elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                    flags[tok[2:]] = rest[i + 1]
                    i += 1
                else:
                    flags[tok[2:]] = "true"
            elif tok in ("-tp", "-pp") and i + 1 < len(rest):
                flags["tensor-parallel-size" if tok == "-tp" else "pipeline-parallel-size"] = rest[i + 1]
                i += 1
            else:
                positional.append(tok)
            i += 1
        backend = flags.get("distributed-executor-backend", "ray" if via_serve_sh else "")
        return {
            "model": positional[0] if positional else flags.get("model", ""),
            "tp": _int(flags.get("tensor-parallel-size", 1)),
            "pp": _int(flags.get("pipeline-parallel-size", 1)),
            "speculative_config": flags.get("speculative-config"),
            "backend": backend,
            "port": _int(flags.get("port", 8000)),
            "via_serve_sh": via_serve_sh,
        }
    return None


def _mount_for(path: str, container: dict, pod_spec: dict) -> tuple[dict, dict, str] | None:
    """(volumeMount, volume, path inside the volume) of the deepest mount containing `path`."""
    best = None
    for mount in container.get("volumeMounts") or []:
        mp = mount.get("mountPath", "").rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[0].get("mountPath", "").rstrip("/")):
                volume = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == mount.get("name")), {})
                best = (mount, volume, path[len(mp) :].lstrip("/"))
    return best


# --------------------------------------------------------------------------------------------- topology


def _pods_of(workload: Resource) -> list[tuple[str, dict, int]]:
    """(role, pod template, how many such pods per serving instance)."""
    if workload["kind"] == "Deployment":
        return [("pod", workload["spec"]["template"], 1)]
    lwt = workload.get("spec", {}).get("leaderWorkerTemplate", {})
    size = _int(lwt.get("size", 1)) or 1
    worker = lwt.get("workerTemplate") or {}
    leader = lwt.get("leaderTemplate") or worker
    pods = [("leader", leader, 1)]
    if size > 1:
        pods.append(("worker", worker, size - 1))
    return pods


def check_rendered(resources: list[Resource]) -> list[str]:
    """Every way the rendered manifests can disagree with themselves. Empty list = consistent."""
    problems: list[str] = []
    configmaps = {_name(r): r for r in _by_kind(resources, "ConfigMap")}
    pvcs = {_name(r): r for r in _by_kind(resources, "PersistentVolumeClaim")}
    workloads = [r for r in resources if r.get("kind") in WORKLOAD_KINDS]
    if not workloads:
        problems.append("no Deployment or LeaderWorkerSet rendered")
    for kind in {r.get("kind") for r in resources} - CORE_KINDS - {"LeaderWorkerSet"}:
        problems.append(f"unexpected kind {kind!r}: the checks know {sorted(CORE_KINDS | {'LeaderWorkerSet'})}")

    for wl in workloads:
        wname = f"{wl['kind']}/{_name(wl)}"
        pods = _pods_of(wl)
        pods_per_instance = sum(n for _, _, n in pods)
        anns = wl.get("metadata", {}).get("annotations") or {}
        nodes = _int(anns.get(ANN_NODES))
        gpn = _int(anns.get(ANN_GPUS_PER_NODE))
        if nodes is None or gpn is None:
            problems.append(f"{wname}: annotations {ANN_NODES} and {ANN_GPUS_PER_NODE} must state the topology")

        serve = None
        serve_role = serve_container = serve_tpl = None
        total_gpus = 0
        for role, tpl, count in pods:
            spec = tpl.get("spec") or {}
            pod_gpus = _pod_gpus(spec)
            total_gpus += pod_gpus * count
            where = f"{wname} {role}"
            for c in spec.get("containers") or []:
                req, lim = _gpus(c)
                if req != lim:
                    problems.append(f"{where}/{c.get('name')}: {GPU} request {req} != limit {lim}")
                found = find_serve(c)
                if found is not None:
                    if serve is not None:
                        problems.append(f"{wname}: more than one container runs vllm serve")
                    serve, serve_role, serve_container, serve_tpl = found, role, c, tpl
            for c in spec.get("containers") or []:
                image = str(c.get("image", ""))
                if "@" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
                    problems.append(f"{where}/{c.get('name')}: image {image!r} needs an explicit tag or digest")
            if pod_gpus == 0:
                problems.append(f"{where}: requests no {GPU}")
            if gpn is not None and pod_gpus != gpn:
                problems.append(f"{where}: {GPU} limit {pod_gpus} per pod != {ANN_GPUS_PER_NODE} {gpn}")
            problems += _check_pod_basics(where, spec, configmaps, pvcs)

        if nodes is not None and pods_per_instance != nodes:
            what = "LeaderWorkerSet size" if wl["kind"] == "LeaderWorkerSet" else "pods per instance"
            problems.append(f"{wname}: {what} {pods_per_instance} != {ANN_NODES} {nodes}")
        if serve is None:
            problems.append(f"{wname}: no container runs `vllm serve` (or deploy/ray/serve.sh)")
            continue
        tp, pp = serve["tp"], serve["pp"]
        if tp is None or pp is None or tp < 1 or pp < 1:
            problems.append(f"{wname}: tensor/pipeline parallel sizes must be integers >= 1, got {tp}, {pp}")
        elif total_gpus != tp * pp:
            problems.append(
                f"{wname}: GPUs per instance {total_gpus} (GPUs per pod x pods) != "
                f"tensor-parallel-size {tp} x pipeline-parallel-size {pp} = {tp * pp}"
            )
        if pods_per_instance > 1:
            problems += _check_multinode(wname, wl, serve, pods, pvcs)
        images = {c.get("image") for _r, t, _n in pods for c in (t.get("spec") or {}).get("containers") or []}
        if len(images) > 1:
            problems.append(f"{wname}: pods run different images {sorted(map(str, images))}; Ray needs one build")
        replicas = _int(wl.get("spec", {}).get("replicas", 1)) or 0
        if wl["kind"] == "Deployment" and replicas > 1:
            for vol in wl["spec"]["template"].get("spec", {}).get("volumes") or []:
                claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
                modes = pvcs.get(claim, {}).get("spec", {}).get("accessModes", [])
                if claim in pvcs and not {"ReadWriteMany", "ReadOnlyMany"} & set(modes):
                    problems.append(f"{wname}: {replicas} replicas share PVC {claim} ({modes}): needs ReadWriteMany")
        if serve_role not in ("pod", "leader"):
            problems.append(f"{wname}: vllm serve must run in the leader pod, found in {serve_role}")
        problems += _check_serving_pod(wname, wl, serve, serve_container, serve_tpl, configmaps, resources)
    return problems


def _check_pod_basics(where: str, spec: dict, configmaps: dict, pvcs: dict) -> list[str]:
    problems = []
    for vol in spec.get("volumes") or []:
        if "configMap" in vol and vol["configMap"].get("name") not in configmaps:
            problems.append(
                f"{where}: volume {vol['name']} references missing ConfigMap {vol['configMap'].get('name')}"
            )
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        if "persistentVolumeClaim" in vol and claim not in pvcs:
            problems.append(f"{where}: volume {vol['name']} references missing PVC {claim}")
    for c in spec.get("containers") or []:
        mount = _mount_for("/dev/shm", c, spec)
        if mount is None or mount[0].get("mountPath") != "/dev/shm":
            problems.append(f"{where}/{c.get('name')}: no /dev/shm mount (NCCL needs more than 64 MiB)")
        elif (mount[1].get("emptyDir") or {}).get("medium") != "Memory":
            problems.append(f"{where}/{c.get('name')}: /dev/shm must be an emptyDir with medium Memory")
    return problems


def _check_multinode(wname, wl, serve, pods, pvcs) -> list[str]:
    problems = []
    if wl["kind"] != "LeaderWorkerSet":
        problems.append(f"{wname}: a multi-pod instance must be a LeaderWorkerSet")
        return problems
    if serve["backend"] != "ray":
        problems.append(
            f"{wname}: multi-node serving needs --distributed-executor-backend ray, got {serve['backend']!r}"
        )
    if wl.get("spec", {}).get("startupPolicy") == "LeaderReady":
        problems.append(
            f"{wname}: startupPolicy LeaderReady deadlocks (the leader is ready only after the workers join Ray); "
            "use LeaderCreated"
        )
    worker_tpl = next(t for role, t, _ in pods if role == "worker")
    worker_cmds = [
        _strip_exec(seg) for c in worker_tpl.get("spec", {}).get("containers", []) for seg in command_segments(c)
    ]
    if not any(seg and Path(seg[0]).name == "start-worker.sh" for seg in worker_cmds):
        problems.append(f"{wname} worker: does not run deploy/ray/start-worker.sh")
    elif not any("LWS_LEADER_ADDRESS" in " ".join(seg) for seg in worker_cmds):
        problems.append(f"{wname} worker: start-worker.sh is not pointed at $LWS_LEADER_ADDRESS")
    for _role, tpl, _n in pods:
        for vol in tpl.get("spec", {}).get("volumes") or []:
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            if claim in pvcs and "ReadWriteMany" not in pvcs[claim].get("spec", {}).get("accessModes", []):
                problems.append(f"{wname}: PVC {claim} is shared by pods on several nodes: needs ReadWriteMany")
    return sorted(set(problems), key=problems.index)


def _check_serving_pod(wname, wl, serve, container, tpl, configmaps, resources) -> list[str]:
    problems = []
    spec = tpl.get("spec") or {}
    cname = f"{wname}/{container.get('name')}"
    port = serve["port"] or 8000
    # echo.json: a mounted ConfigMap file, never an inline JSON string.
    path = serve["speculative_config"]
    if not path:
        problems.append(f"{cname}: no --speculative-config")
    elif path.lstrip().startswith("{"):
        problems.append(f"{cname}: --speculative-config must be the mounted file, not inline JSON")
    else:
        found = _mount_for(path, container, spec)
        cm = configmaps.get(((found or ({}, {}, ""))[1].get("configMap") or {}).get("name"))
        if found is None or cm is None:
            problems.append(f"{cname}: --speculative-config {path} is not inside a mounted ConfigMap")
        elif found[2] not in (cm.get("data") or {}):
            problems.append(f"{cname}: ConfigMap {_name(cm)} has no key {found[2]!r} for {path}")
        else:
            raw = cm["data"][found[2]]
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as err:
                problems.append(f"ConfigMap {_name(cm)}/{found[2]}: invalid JSON ({err.msg})")
            else:
                problems += check_speculative_config(data, f"ConfigMap {_name(cm)}/{found[2]}")
                problems += _check_engine_combinations(data, serve, f"{cname}")
                for key in ("model",):
                    value = data.get(key)
                    if isinstance(value, str) and value.startswith("/") and _mount_for(value, container, spec) is None:
                        problems.append(f"ConfigMap {_name(cm)}/{found[2]}: {key} {value} is on no mounted volume")
    if serve["model"].startswith("/") and _mount_for(serve["model"], container, spec) is None:
        problems.append(f"{cname}: model {serve['model']} is on no mounted volume")
    # Health, shutdown, metrics.
    for probe in ("readinessProbe", "livenessProbe"):
        get = (container.get(probe) or {}).get("httpGet") or {}
        if get.get("path") != "/health":
            problems.append(f"{cname}: {probe} must be httpGet /health")
        elif not _port_matches(get.get("port"), port, container):
            problems.append(f"{cname}: {probe} port {get.get('port')} is not the server port {port}")
    if not ((container.get("lifecycle") or {}).get("preStop")):
        problems.append(f"{cname}: no preStop hook")
    if (_int(spec.get("terminationGracePeriodSeconds")) or 30) < 30:
        problems.append(f"{cname}: terminationGracePeriodSeconds below 30 s cuts in-flight requests")
    anns = (tpl.get("metadata") or {}).get("annotations") or {}
    if anns.get("prometheus.io/scrape") != "true" or anns.get("prometheus.io/path") != "/metrics":
        problems.append(f"{wname}: serving pod template lacks prometheus.io/scrape 'true' and path /metrics")
    if _int(anns.get("prometheus.io/port")) != port:
        problems.append(f"{wname}: prometheus.io/port {anns.get('prometheus.io/port')} != server port {port}")
    # The Service must reach the serving pods and nothing else.
    labels = (tpl.get("metadata") or {}).get("labels") or {}
    services = _by_kind(resources, "Service")
    if not services:
        problems.append(f"{wname}: no Service")
    for svc in services:
        selector = svc.get("spec", {}).get("selector") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"Service/{_name(svc)}: selector {selector} does not match the serving pods {labels}")
        for sp in svc.get("spec", {}).get("ports") or []:
            if not _port_matches(sp.get("targetPort", sp.get("port")), port, container):
                problems.append(f"Service/{_name(svc)}: targetPort {sp.get('targetPort')} is not the server port")
    for role, worker_tpl, _n in _pods_of(wl):
        if role != "worker":
            continue
        worker_labels = (worker_tpl.get("metadata") or {}).get("labels") or {}
        for svc in services:
            selector = svc.get("spec", {}).get("selector") or {}
            if selector and all(worker_labels.get(k) == v for k, v in selector.items()):
                problems.append(f"Service/{_name(svc)}: selector also matches the Ray worker pods")
    return problems


def _port_matches(ref: Any, port: int, container: dict) -> bool:
    if isinstance(ref, str) and not ref.isdigit():
        return any(p.get("name") == ref and p.get("containerPort") == port for p in container.get("ports") or [])
    return _int(ref) == port
