"""The ECHO speculative config (`{"method": "echo", ...}`) and its translation into what vLLM validates.

No vLLM import here: the argparse type, the engine-config patch, the manifest checks (`validate(spec,
check_files=False)`) and the tests share these functions, so a file the checks pass is one `vllm serve` takes.

    {"method": "echo", "model": "<EAGLE-3 head>", "num_speculative_tokens": <max depth>, "echo": {EchoSettings}}

becomes the eagle3 config `{"method": "eagle3", "model": ..., "num_speculative_tokens": ...}` (every other key
passes through to vLLM's SpeculativeConfig, which rejects unknown ones, once `combinations.RULES` allowed it)
plus the payload stored in `VllmConfig.additional_config["echo"]`, which reaches every worker with the config
itself:

    {"settings": EchoSettings.model_dump(), "max_depth": D, "head": "<head path>"}
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_vllm.config import EchoConfigError, EchoSettings, load_json_or_path, parse_echo_settings
from echo_vllm.vllm import combinations

ECHO_METHOD = "echo"
ADDITIONAL_CONFIG_KEY = "echo"


def is_echo_request(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("method") == ECHO_METHOD


LOCAL_PATH_PREFIXES = (".", "/", "~")


@dataclass(frozen=True)
class EchoSpec:
    """A validated echo.json: the head's path, the max draft depth and the `echo` settings."""

    head: str
    max_depth: int
    settings: EchoSettings


def _head_problem(model: Any, check_files: bool) -> str | None:
    if not isinstance(model, str) or not model:
        return "'model' (the EAGLE-3 head) is required for method 'echo'"
    path = Path(model).expanduser()
    looks_local = model.startswith(LOCAL_PATH_PREFIXES) or (check_files and path.exists())
    if not looks_local:
        # vLLM would resolve a hub id, but the plugin loads the head itself, from a directory only.
        where = "does not exist locally" if check_files else "is not a path (a hub id?)"
        return f"model {model!r} (the EAGLE-3 head) {where}; give the head's path"
    if check_files and not (path / "config.json").is_file():
        return f"model {model!r} (the EAGLE-3 head) is not a directory with a config.json; give the path of the head"
    return None


def _depth_problem(value: Any) -> str | None:
    if value is None:
        return "'num_speculative_tokens' (max draft depth) is required for method 'echo'"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"num_speculative_tokens must be an integer >= 1 (the max draft depth); got {value!r}"
    return None


def _calibration_problem(settings: EchoSettings, max_depth: int) -> str | None:
    """Load an existing calibration file now so a corrupt one fails before anything is served."""
    if not settings.calibration_file:
        return None
    path = Path(settings.calibration_file).expanduser()
    if not path.exists():
        return None
    from echo_vllm.core.calibration import Calibration, CalibrationError  # lazy: torch, only if needed

    try:
        Calibration.load(path, expected_max_depth=max_depth, expected_mode=settings.gate_mode)
    except CalibrationError as err:
        return f"echo.calibration_file: {err}"
    return None


def spec_problems(spec: Any, *, check_files: bool = True) -> tuple[EchoSpec | None, list[str]]:
    """(the validated spec or None, every problem found). `check_files=False` checks what can be checked away
    from the serving machine (a manifest linter): the head must be a path, but neither it nor the calibration
    file is looked at."""
    if not isinstance(spec, dict):
        return None, ["must be a JSON object"]
    problems = []
    if not is_echo_request(spec):
        problems.append(f"method must be 'echo', got {spec.get('method')!r}")
    depth_problem = _depth_problem(spec.get("num_speculative_tokens"))
    head_problem = _head_problem(spec.get("model"), check_files)
    problems += [p for p in (depth_problem, head_problem) if p]
    problems += combinations.spec_problems(spec)  # options that would make ECHO lossy or silently wrong
    try:
        settings = parse_echo_settings(spec.get("echo"))
    except EchoConfigError as err:
        problems.append(str(err))
        return None, problems
    if depth_problem is None and check_files:
        calibration_problem = _calibration_problem(settings, spec["num_speculative_tokens"])
        problems += [calibration_problem] if calibration_problem else []
    if problems:
        return None, problems
    head = str(Path(spec["model"]).expanduser())
    return EchoSpec(head=head, max_depth=spec["num_speculative_tokens"], settings=settings), []


def validate(spec: Any, *, check_files: bool = True) -> EchoSpec:
    """The one validator of echo.json, for `vllm serve` (check_files=True) and the manifest checks (False);
    EchoConfigError naming every problem."""
    valid, problems = spec_problems(spec, check_files=check_files)
    if valid is None:
        raise EchoConfigError("speculative config: " + "; ".join(problems))
    return valid


def translate(spec: dict[str, Any], *, trees_supported: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(eagle3 speculative config for vLLM, payload for additional_config['echo']); EchoConfigError if invalid.

    With echo.top_k > 1 (and `trees_supported`: the platform has the tree attention backend) requests draft
    trees: vLLM's num_speculative_tokens becomes the tree capacity max_depth * top_k, which sizes its per-request
    draft buffers, KV lookahead and spec-decode statistics; the payload keeps the draft depth.
    """
    valid = validate(spec, check_files=True)
    eagle = {k: v for k, v in spec.items() if k != "echo"}
    eagle["method"] = "eagle3"
    eagle["model"] = valid.head
    trees = trees_supported and valid.settings.top_k > 1
    if trees:
        from echo_vllm.vllm.tree_state import MAX_TREE_NODES  # lazy: torch is not needed to validate a config

        capacity = valid.max_depth * valid.settings.top_k
        if capacity > MAX_TREE_NODES:
            raise EchoConfigError(
                f"speculative config: num_speculative_tokens x echo.top_k = {capacity} exceeds the tree capacity "
                f"{MAX_TREE_NODES}; lower echo.top_k or num_speculative_tokens"
            )
        eagle["num_speculative_tokens"] = capacity
    payload = {
        "settings": valid.settings.model_dump(),
        "max_depth": valid.max_depth,
        "head": valid.head,
        "tree": trees,
    }
    return eagle, payload


def settings_from_payload(payload: dict[str, Any]) -> EchoSettings:
    return parse_echo_settings(payload.get("settings"))


def echo_payload(vllm_config: Any) -> dict[str, Any] | None:
    """additional_config['echo'] of a VllmConfig, or None when ECHO is not requested."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        payload = extra.get(ADDITIONAL_CONFIG_KEY)
        if isinstance(payload, dict):
            return payload
    return None


def speculative_config_arg(value: str, vllm_type: Callable[[str], Any] | None = None) -> dict[str, Any] | None:
    """argparse `type` for --speculative-config: what vLLM's own parser accepts, plus a path to a JSON file.

    `vllm_type` is vLLM's parser for the flag (`optional_type(json.loads)`: "" and "None" mean no speculation, a
    JSON object string is parsed); everything it accepts is returned as vLLM returns it, so the plugin changes
    nothing for configs that are not ECHO. Only a value vLLM rejects is looked at again: an existing file is read as
    JSON, anything else is one line saying why. An ECHO config is validated here, so bad input ends at argument parsing with one line (exit 2).
    """
    data: Any
    try:
        if vllm_type is None:
            data = load_json_or_path(value)
        else:
            try:
                data = vllm_type(value)
            except (argparse.ArgumentTypeError, ValueError):
                # Rejected by vLLM: a JSON file path is read; anything else gets the one-line reason.
                data = load_json_or_path(value)
        if isinstance(data, dict) and is_echo_request(data):
            translate(data)
    except EchoConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return data


def load_spec(value: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    return load_json_or_path(value)


def dumps(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)
