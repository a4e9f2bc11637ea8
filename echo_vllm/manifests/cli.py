"""`echo-vllm deploy check|echo-json|ray-gpus`: the manifest checks from the command line.

    echo-vllm deploy check deploy/k8s/overlays/llama-70b        # render + schemas + topology (needs a checkout)
    echo-vllm deploy echo-json deploy/k8s/overlays/llama-70b/echo.json
    echo-vllm deploy ray-gpus --need 16                         # on a Ray head node (deploy/ray/serve.sh)

Exit 0 when everything holds, 1 with one line per problem on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _check(args: argparse.Namespace) -> int:
    from echo_vllm.manifests.checks import check_rendered
    from echo_vllm.manifests.render import DeployCheckError, render
    from echo_vllm.manifests.schemas import DEFAULT_K8S_VERSION, validate_schemas

    problems = []
    for directory in args.dirs:
        try:
            resources = render(directory)
        except DeployCheckError as err:
            problems.append(str(err))
            continue
        found = check_rendered(resources)
        if not args.no_schemas:
            found += validate_schemas(resources, args.k8s_version or DEFAULT_K8S_VERSION)
        problems += [f"{directory}: {p}" for p in found]
        if not found:
            print(f"{directory}: OK ({len(resources)} resources)")
    return _report(problems)


def _echo_json(args: argparse.Namespace) -> int:
    from echo_vllm.config import EchoConfigError, load_json_or_path
    from echo_vllm.manifests.checks import check_speculative_config

    try:
        problems = check_speculative_config(load_json_or_path(args.value), args.value)
    except EchoConfigError as err:
        problems = [str(err)]
    return _report(problems)


def _ray_gpus(args: argparse.Namespace) -> int:
    from echo_vllm.manifests.ray_cluster import ray_gpus

    try:
        have = ray_gpus(args.address)
    except Exception as err:  # noqa: BLE001 - any connection failure is the message
        print(f"cannot reach the Ray cluster at {args.address}: {err}", file=sys.stderr)
        return 1
    problems = [] if have >= args.need else [f"Ray cluster has {have:g} GPUs, vLLM needs TP x PP = {args.need}"]
    if not problems:
        print(f"Ray cluster has {have:g} GPUs (need {args.need})")
    return _report(problems)


def _report(problems: list[str]) -> int:
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


def add_subcommand(sub: Any) -> None:
    deploy = sub.add_parser("deploy", help="check deploy/ manifests, an echo.json, or a Ray cluster's GPUs")
    dsub = deploy.add_subparsers(dest="deploy_command", required=True)
    p_check = dsub.add_parser(
        "check",
        help="render kustomization dirs and run every check (kustomize, pyyaml, "
        "kubernetes-validate: the test extra; the overlays ship in a checkout's deploy/)",
    )
    p_check.add_argument("dirs", nargs="+")
    p_check.add_argument(
        "--k8s-version",
        help="Kubernetes version of the schemas (default: echo_vllm.manifests.schemas.DEFAULT_K8S_VERSION)",
    )
    p_check.add_argument("--no-schemas", action="store_true", help="skip schema validation")
    p_check.set_defaults(func=_check)
    p_echo = dsub.add_parser(
        "echo-json",
        help="validate an echo.json (a path or a JSON string) as a manifest: the "
        "head must be a path, the files are not looked at",
    )
    p_echo.add_argument("value")
    p_echo.set_defaults(func=_echo_json)
    p_ray = dsub.add_parser("ray-gpus", help="fail unless the Ray cluster has at least --need GPUs")
    p_ray.add_argument("--need", type=int, required=True)
    p_ray.add_argument("--address", default="auto")
    p_ray.set_defaults(func=_ray_gpus)
