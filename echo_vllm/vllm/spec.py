"""The ECHO speculative config (`{"method": "echo", ...}`) and its translation into what vLLM validates.

No vLLM import here: the argparse type, the engine-config patch and the tests share these functions.

    {"method": "echo", "model": "<EAGLE-3 head>", "num_speculative_tokens": <max depth>, "echo": {EchoSettings}}

becomes the eagle3 config `{"method": "eagle3", "model": ..., "num_speculative_tokens": ...}` (every other key
passes through to vLLM's SpeculativeConfig, which rejects unknown ones) plus the payload stored in
`VllmConfig.additional_config["echo"]`, which reaches every worker with the config itself:

    {"settings": EchoSettings.model_dump(), "max_depth": D, "head": "<head path>"}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from echo_vllm.config import EchoConfigError, EchoSettings, load_json_or_path, parse_echo_settings

ECHO_METHOD = "echo"
ADDITIONAL_CONFIG_KEY = "echo"


def is_echo_request(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("method") == ECHO_METHOD


def _check_head(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise EchoConfigError("speculative config: 'model' (the EAGLE-3 head) is required for method 'echo'")
    path = Path(model).expanduser()
    looks_local = model.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path / "config.json").is_file():
        raise EchoConfigError(
            f"speculative config: model {model!r} (the EAGLE-3 head) is not a directory with a config.json; "
            "give the path of the head"
        )
    if not looks_local:
        raise EchoConfigError(
            f"speculative config: model {model!r} (the EAGLE-3 head) does not exist locally; give the head's path"
        )
    return str(path)


def _check_depth(value: Any) -> int:
    if value is None:
        raise EchoConfigError("speculative config: 'num_speculative_tokens' (max draft depth) is required for 'echo'")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EchoConfigError(
            f"speculative config: 'num_speculative_tokens' (max draft depth) must be an integer >= 1; got {value!r}"
        )
    return value


def check_calibration_file(settings: EchoSettings, max_depth: int) -> None:
    """Load an existing calibration file now so a corrupt one fails before anything is served."""
    if not settings.calibration_file:
        return
    path = Path(settings.calibration_file).expanduser()
    if not path.exists():
        return
    from echo_vllm.core.calibration import Calibration, CalibrationError  # noqa: PLC0415

    try:
        Calibration.load(path, expected_max_depth=max_depth, expected_mode=settings.gate_mode)
    except CalibrationError as err:
        raise EchoConfigError(f"echo.calibration_file: {err}") from None


def translate(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(eagle3 speculative config for vLLM, payload for additional_config['echo']); EchoConfigError if invalid."""
    if not is_echo_request(spec):
        raise EchoConfigError("speculative config: method must be 'echo'")
    depth = _check_depth(spec.get("num_speculative_tokens"))
    head = _check_head(spec.get("model"))
    settings = parse_echo_settings(spec.get("echo"))
    check_calibration_file(settings, depth)
    eagle = {k: v for k, v in spec.items() if k != "echo"}
    eagle["method"] = "eagle3"
    eagle["model"] = head
    payload = {"settings": settings.model_dump(), "max_depth": depth, "head": head}
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


def speculative_config_arg(value: str) -> dict[str, Any]:
    """argparse `type` for --speculative-config: a JSON object string or a path to a JSON file.

    An ECHO config is validated here, so bad input ends at argument parsing with one line (exit 2).
    """
    try:
        data = load_json_or_path(value)
        if is_echo_request(data):
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
