"""ECHO core: plain-torch draft trees, gates, calibration, elastic budget selection, verification, metrics."""

from .budget import (
    CLASS_DEPTH,
    CLASS_EXCLUDED,
    CLASS_WIDTH,
    BudgetSelection,
    VerifierInputs,
    add_surplus_tails,
    candidate_class,
    check_budget_inputs,
    compact_selection,
    select_budget_reference,
    verifier_inputs,
)
from .calibration import (
    Calibration,
    CalibrationError,
    CalibrationRecorder,
    auc,
    calibrate,
    youden_threshold,
)
from .gating import Gates, depth_confidence, gate_caps, width_eligible
from .metrics import EchoMetrics
from .tree import (
    Drafter,
    DraftTree,
    SyntheticDrafter,
    depth_major_layout,
    grow_spine_siblings,
    grow_tree,
    topk_stable,
)
from .verify import VerifyResult, verify_greedy, verify_sampling

__all__ = [
    "CLASS_DEPTH",
    "CLASS_EXCLUDED",
    "CLASS_WIDTH",
    "BudgetSelection",
    "Calibration",
    "CalibrationError",
    "CalibrationRecorder",
    "DraftTree",
    "Drafter",
    "EchoMetrics",
    "Gates",
    "SyntheticDrafter",
    "VerifierInputs",
    "VerifyResult",
    "add_surplus_tails",
    "auc",
    "calibrate",
    "candidate_class",
    "check_budget_inputs",
    "compact_selection",
    "depth_confidence",
    "depth_major_layout",
    "gate_caps",
    "grow_spine_siblings",
    "grow_tree",
    "select_budget_reference",
    "topk_stable",
    "verifier_inputs",
    "verify_greedy",
    "verify_sampling",
    "width_eligible",
    "youden_threshold",
]
