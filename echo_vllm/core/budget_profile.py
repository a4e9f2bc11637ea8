"""The budget profile file: the fitted `CostModel` and the `AcceptanceModel` counts, saved next to the calibration.

Written once after the start-up profile (atomically, by TP rank 0) if the file does not exist, and loaded at the
next start so that the time-aware budget needs no profile steps. Any problem raises CalibrationError with one
line naming the file, the field and the fix (delete the file to profile again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo_vllm.core.acceptance import AcceptanceModel
from echo_vllm.core.atomic_file import atomic_write_text
from echo_vllm.core.cost_model import (
    DRAFT_TERMS,
    FIRST_PASS_TERMS,
    LOOP_TERMS,
    TREE_DRAFT_TERMS,
    TREE_TERMS,
    VERIFY_TERMS,
    CostModel,
)
from echo_vllm.errors import CalibrationError

SCHEMA_VERSION = 1
KIND = "echo-vllm budget profile"
FIX = "delete it to profile again at start-up"


class _CostModelJson(BaseModel):
    model_config = ConfigDict(extra="forbid")
    knots: list[float] = Field(min_length=2)
    rest_s: list[float] = Field(min_length=2)
    per_request_s: float = Field(ge=0)
    draft_terms: list[float] = Field(min_length=DRAFT_TERMS, max_length=DRAFT_TERMS)
    fit_error: float = Field(ge=0)
    num_samples: int = Field(ge=0)
    # Added with tree verification; profiles written before it have none (chains only: no tree cost).
    tree_terms: list[float] = Field(default_factory=lambda: [0.0, 0.0], min_length=TREE_TERMS, max_length=TREE_TERMS)
    # Added with the first-pass draft cost; profiles written before it have none (the model linear in depth).
    first_pass_terms: list[float] = Field(
        default_factory=lambda: [0.0, 0.0], min_length=FIRST_PASS_TERMS, max_length=FIRST_PASS_TERMS
    )
    verify_terms: list[float] = Field(
        default_factory=lambda: [0.0, 0.0], min_length=VERIFY_TERMS, max_length=VERIFY_TERMS
    )
    # Added with the deferred head rows' term; profiles written before it have none (plain steps free of head work).
    deferred_row_s: float = Field(default=0.0, ge=0)
    # Added with the context term; profiles written before it have none (the curve in N carries the context).
    context_s: float = Field(default=0.0, ge=0)
    # Added with the tree-drafting term; profiles written before it have none (tree drafting priced as chains).
    tree_draft_terms: list[float] = Field(
        default_factory=lambda: [0.0, 0.0], min_length=TREE_DRAFT_TERMS, max_length=TREE_DRAFT_TERMS
    )
    # Added with the chained loop's entry term; profiles written before it have none (depth 2 on the per-depth line).
    loop_terms: list[float] = Field(default_factory=lambda: [0.0, 0.0], min_length=LOOP_TERMS, max_length=LOOP_TERMS)
    # Added with the prompt-row term; profiles written before it have none (joining steps' rows in the other terms).
    prompt_row_s: float = Field(default=0.0, ge=0)


class _AcceptanceJson(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_bins: int = Field(ge=1, le=1024)
    prior_strength: float = Field(gt=0)
    accepted: list[list[float]]
    seen: list[list[float]]


class BudgetProfileFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["echo-vllm budget profile"]
    schema_version: Literal[1]
    max_depth: int = Field(ge=1)
    cost_model: _CostModelJson
    acceptance: _AcceptanceJson


def default_profile_path(calibration_file: str | None) -> Path | None:
    """`<calibration stem>.budget.json` next to the calibration file (None without one)."""
    if not calibration_file:
        return None
    cal = Path(calibration_file).expanduser()
    return cal.with_name(f"{cal.stem}.budget.json")


def save_profile(path: str | os.PathLike[str], cost: CostModel, acceptance: AcceptanceModel) -> None:
    data = {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "max_depth": acceptance.max_depth,
        "cost_model": {
            "knots": list(cost.knots),
            "rest_s": list(cost.rest_s),
            "per_request_s": cost.per_request_s,
            "draft_terms": list(cost.draft_terms),
            "fit_error": cost.fit_error,
            "num_samples": cost.num_samples,
            "tree_terms": list(cost.tree_terms),
            "first_pass_terms": list(cost.first_pass_terms),
            "verify_terms": list(cost.verify_terms),
            "deferred_row_s": cost.deferred_row_s,
            "context_s": cost.context_s,
            "tree_draft_terms": list(cost.tree_draft_terms),
            "loop_terms": list(cost.loop_terms),
            "prompt_row_s": cost.prompt_row_s,
        },
        "acceptance": acceptance.to_json_dict(),
    }
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """The cost model of a budget profile, whatever its max_depth (the benchmark's oracle bound reads it)."""
    try:
        depth = int(json.loads(Path(path).read_text()).get("max_depth", 0))
    except (OSError, ValueError, AttributeError):
        depth = 0  # load_profile reports the actual problem
    return load_profile(path, max(depth, 1))[0]


def load_profile(
    path: str | os.PathLike[str], expected_max_depth: int, device: Any = "cpu"
) -> tuple[CostModel, AcceptanceModel]:
    where = f"budget profile file {str(path)!r}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CalibrationError(f"{where}: cannot be read ({err.strerror}); {FIX}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{where}: not valid JSON ({err.msg} at line {err.lineno}); {FIX}") from None
    try:
        data = BudgetProfileFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise CalibrationError(f"{where}: field {field!r}: {first['msg']}; {FIX}") from None
    if data.max_depth != expected_max_depth:
        raise CalibrationError(
            f"{where}: field 'max_depth' is {data.max_depth} but this deployment drafts {expected_max_depth} "
            f"depths; {FIX} (or point budget_profile_file elsewhere)"
        )
    c = data.cost_model
    try:
        cost = CostModel(
            tuple(c.knots),
            tuple(c.rest_s),
            c.per_request_s,
            (c.draft_terms[0], c.draft_terms[1], c.draft_terms[2], c.draft_terms[3]),
            c.fit_error,
            c.num_samples,
            (c.tree_terms[0], c.tree_terms[1]),
            (c.first_pass_terms[0], c.first_pass_terms[1]),
            (c.verify_terms[0], c.verify_terms[1]),
            c.deferred_row_s,
            c.context_s,
            (c.tree_draft_terms[0], c.tree_draft_terms[1]),
            (c.loop_terms[0], c.loop_terms[1]),
            c.prompt_row_s,
        )
        acceptance = AcceptanceModel.from_json_dict(data.acceptance.model_dump(), expected_max_depth, device)
    except (ValueError, RuntimeError) as err:
        raise CalibrationError(f"{where}: {err}; {FIX}") from None
    return cost, acceptance
