"""`bench hf`'s per-method settings: the typed setting of one method, today's defaults, the tuned file
(echo_vllm/bench/hf_tuned.json, written by `bench hf-tune`), CLI overrides and the drafter directory.

A method's setting is what its sweep varies (issue #14): eagle2 / siblings total tokens (k_max) x top_k x depth,
chain its depth, ddd its threshold and depth limit (on eagle2's pool), the gated methods K_max (an integer or
"auto") x delta. Everything else (warm-up steps, max_gates, min_gain, surplus_width) is one base EchoSettings
shared by every method of a run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from echo_vllm.config import EchoSettings, format_validation_error
from echo_vllm.core.eagle2 import DDDSettings
from echo_vllm.errors import ConfigError, InputError
from echo_vllm.hf.draft_model import DrafterError, parse_drafter_spec  # noqa: F401 (DrafterError: re-exported)
from echo_vllm.hf.engine import GATED, METHOD_SPECS, METHODS, EngineOptions

TUNED_PATH = Path(__file__).with_name("hf_tuned.json")
DRAFTERS = ("eagle3", "draft-model")
TUNED_VERSION = 1


class TunedSettingsError(ConfigError):
    """A tuned-settings file (hf_tuned.json) that cannot be used; the message names the file, key and fix."""


@dataclass(frozen=True)
class MethodSetting:
    """One method's knobs. `k_max` is the total draft tokens verified per step (eagle2's total_tokens; "auto" =
    ECHO's time-aware budget, gated methods only); chain ignores k_max and top_k (K = max_depth, top_k 1); ddd's
    depth limit is `ddd_max_depth` (not max_depth) and its pool is reranked to k_max like eagle2's."""

    method: str
    max_depth: int = 6
    k_max: int | str = 16
    top_k: int = 4
    delta: float = 0.6
    ddd_threshold: float = -4.0
    ddd_max_depth: int = 10
    ddd_check_depths: tuple[int, ...] = (4, 6, 8)

    # Which fields mean something for which method: the JSON and the printed setting carry only these.
    def relevant(self) -> dict[str, Any]:
        spec = METHOD_SPECS[self.method]
        if not spec.drafts:
            return {}
        if spec.chain:
            return {"max_depth": self.max_depth}
        out: dict[str, Any] = {"k_max": self.k_max, "top_k": self.top_k}
        if spec.ddd:
            out |= {
                "ddd_threshold": self.ddd_threshold,
                "ddd_max_depth": self.ddd_max_depth,
                "ddd_check_depths": list(self.ddd_check_depths),
            }
        else:
            out["max_depth"] = self.max_depth
        if spec.gate_mode == "sparse":
            out["delta"] = self.delta  # dense and fixed ignore delta (every depth / one tau)
        return out

    def label(self) -> str:
        """A short name for a sweep's grid point, e.g. eagle2[k8,t4,d6]; ar and defaults print the method."""
        short = {
            "k_max": "k",
            "top_k": "t",
            "max_depth": "d",
            "delta": "δ",
            "ddd_threshold": "h",
            "ddd_max_depth": "D",
            "ddd_check_depths": "c",
        }
        parts = []
        for key, value in self.relevant().items():
            text = (
                "/".join(map(str, value))
                if isinstance(value, list)
                else f"{value:g}"
                if isinstance(value, float)
                else str(value)
            )
            parts.append(f"{short[key]}{text}")
        return f"{self.method}[{','.join(parts)}]" if parts else self.method

    def ddd(self) -> DDDSettings:
        return DDDSettings(
            threshold=self.ddd_threshold, max_depth=self.ddd_max_depth, check_depths=tuple(self.ddd_check_depths)
        )

    def engine_options(self, base: EchoSettings, drafter: str = "eagle3") -> EngineOptions:
        """The engine's options: `base` with this setting's k_max / top_k / delta, validated (one ConfigError line)."""
        spec = METHOD_SPECS[self.method]
        fields = {**base.model_dump(), "top_k": self.top_k, "delta": self.delta}
        if spec.drafts and not spec.chain:
            fields["k_max"] = self.k_max
            if self.k_max == "auto" and spec.gate_mode is None:
                raise ConfigError(
                    f"{self.method}.k_max: 'auto' is ECHO's time-aware budget (echo, dense, fixed); give "
                    f"{self.method} its total of draft tokens per step as an integer"
                )
        try:
            echo = EchoSettings(**fields)
        except ValidationError as err:
            raise ConfigError(f"{self.method}: {format_validation_error(err)}") from None
        options = EngineOptions(
            method=self.method, max_depth=self.max_depth, echo=echo, ddd=self.ddd(), drafter=drafter
        )
        options.validate()
        return options


def default_setting(method: str) -> MethodSetting:
    """Today's defaults (what `bench hf` ran before tuning): depth 6, K_max 16, top_k 4, delta 0.6, ddd -4/10."""
    return MethodSetting(method=method)


# ---- overrides from the command line --------------------------------------------------------------------------

OVERRIDABLE = (
    "max_depth",
    "gated_depth",
    "k_max",
    "top_k",
    "delta",
    "ddd_threshold",
    "ddd_max_depth",
    "ddd_check_depths",
)


def apply_overrides(setting: MethodSetting, overrides: dict[str, Any]) -> MethodSetting:
    """Explicit CLI flags win over the tuned setting for every method they concern. `max_depth` (--depth) sets the
    depth of every drafting method; `gated_depth` (--echo-depth) then sets echo/dense/fixed's (the old meaning)."""
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ConfigError(f"bench hf overrides: unknown {sorted(unknown)}; known: {', '.join(OVERRIDABLE)}")
    changes = {k: v for k, v in overrides.items() if v is not None and k != "gated_depth"}
    if "ddd_check_depths" in changes:
        changes["ddd_check_depths"] = tuple(changes["ddd_check_depths"])
    if overrides.get("gated_depth") is not None and setting.method in GATED:
        changes["max_depth"] = overrides["gated_depth"]
    return dataclasses.replace(setting, **changes)


# ---- the tuned file ---------------------------------------------------------------------------------------------


def setting_from_json(method: str, raw: Any, where: str) -> MethodSetting:
    if method not in METHODS:
        raise TunedSettingsError(f"{where}: unknown method {method!r}; choose from {', '.join(METHODS)}")
    if not isinstance(raw, dict):
        raise TunedSettingsError(f"{where}.{method}: must be a JSON object of setting fields; got {raw!r}")
    allowed = {f.name for f in dataclasses.fields(MethodSetting)} - {"method"}
    unknown = set(raw) - allowed
    if unknown:
        raise TunedSettingsError(
            f"{where}.{method}: unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    fields = dict(raw)
    if "ddd_check_depths" in fields:
        if not isinstance(fields["ddd_check_depths"], list):
            raise TunedSettingsError(f"{where}.{method}.ddd_check_depths: must be a list of integers")
        fields["ddd_check_depths"] = tuple(fields["ddd_check_depths"])
    setting = MethodSetting(method=method, **fields)
    try:
        setting.engine_options(EchoSettings())
    except (ConfigError, InputError, TypeError) as err:
        raise TunedSettingsError(f"{where}.{method}: {err}; rerun `echo-vllm bench hf-tune` or fix the file") from None
    return setting


def load_tuned(path: Path = TUNED_PATH) -> dict[str, dict[str, MethodSetting]]:
    """{drafter: {method: setting}}; a missing file is {} (every method falls back to its defaults), a corrupt one
    a TunedSettingsError naming the key."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TunedSettingsError(f"{path}: not valid JSON ({err}); rerun `echo-vllm bench hf-tune`") from None
    if not isinstance(data, dict) or not isinstance(data.get("drafters"), dict):
        raise TunedSettingsError(
            f"{path}: expected an object with a 'drafters' object; rerun `echo-vllm bench hf-tune`"
        )
    if data.get("version") != TUNED_VERSION:
        raise TunedSettingsError(f"{path}: version {data.get('version')!r}, this code reads {TUNED_VERSION}")
    out: dict[str, dict[str, MethodSetting]] = {}
    for drafter, block in data["drafters"].items():
        where = f"{path.name}: drafters.{drafter}"
        if drafter not in DRAFTERS:
            raise TunedSettingsError(f"{where}: unknown drafter; choose from {', '.join(DRAFTERS)}")
        if not isinstance(block, dict) or not isinstance(block.get("methods"), dict):
            raise TunedSettingsError(f"{where}: expected an object with a 'methods' object")
        out[drafter] = {m: setting_from_json(m, raw, f"{where}.methods") for m, raw in block["methods"].items()}
    return out


def setting_to_json(setting: MethodSetting) -> dict[str, Any]:
    return setting.relevant()


def save_tuned(path: Path, drafter: str, methods: dict[str, MethodSetting], provenance: dict[str, Any]) -> None:
    """Write (or update) one drafter's block, keeping the other drafters' blocks of an existing file."""
    if drafter not in DRAFTERS:
        raise TunedSettingsError(f"drafter {drafter!r}: choose from {', '.join(DRAFTERS)}")
    data: dict[str, Any] = {"version": TUNED_VERSION, "drafters": {}}
    if path.is_file():
        load_tuned(path)  # refuse to build on a corrupt file
        data = json.loads(path.read_text())
    data["drafters"][drafter] = {
        "methods": {m: setting_to_json(s) for m, s in methods.items()},
        "provenance": provenance,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def settings_for_run(
    methods: list[str],
    drafter: str,
    overrides: dict[str, Any] | None = None,
    tuned_path: Path = TUNED_PATH,
    note=print,
) -> dict[str, MethodSetting]:
    """Each method's setting for `bench hf`: the tuned one for this drafter, else the defaults (with a note), then
    the explicit CLI overrides."""
    tuned = load_tuned(tuned_path).get(drafter, {})
    out = {}
    missing = []
    for method in methods:
        if method in tuned:
            setting = tuned[method]
        else:
            setting = default_setting(method)
            if METHOD_SPECS[method].drafts:
                missing.append(method)
        out[method] = apply_overrides(setting, overrides or {})
    if missing:
        note(
            f"[bench hf] no tuned setting for {', '.join(missing)} (drafter {drafter}) in {tuned_path}: "
            "today's defaults (depth 6, K_max 16, top_k 4, delta 0.6); `echo-vllm bench hf-tune` tunes them"
        )
    return out


# ---- the drafter ------------------------------------------------------------------------------------------------


def resolve_drafter(spec: str, root: Path) -> tuple[str, Path]:
    """--drafter: 'eagle3' -> the testbed's EAGLE-3 head, 'draft-model' -> its draft LM, 'KIND:PATH' -> PATH
    (one parser for the engine's and the benchmark's drafter specs: `echo_vllm.hf.draft_model`)."""
    return parse_drafter_spec(spec, root)
