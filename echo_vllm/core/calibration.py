"""Warm-up calibration of the confidence gates (ECHO, "Sparse Confidence Gating").

During warm-up every verification step records, per request i and verified depth d, the pair
(c_{i,d}, accepted_{i,d}): the depth confidence and whether the verified accepted path reached depth d. Only
depths that were actually verified for the request are recorded (d <= the deepest selected depth of request i).

After warm-up, `calibrate` computes per depth
  AUC_d  = Mann-Whitney statistic of the scores of accepted (positive) vs rejected (negative) samples, with
           tie-averaged ranks, i.e. P(c_pos > c_neg) + 0.5 * P(c_pos == c_neg);
  tau_d  = Youden threshold: the observed value tau maximizing TPR - FPR for the rule "keep iff c >= tau";
           among equal J the smallest tau wins (the most permissive gate).
and picks the gated depths by mode:
  sparse: the sweet spots D_sig = {d : AUC_d > delta and both classes have >= min_samples_per_class samples};
  dense:  every depth with >= min_samples_per_class samples of both classes, each with its own tau_d (no AUC
          filter);
  fixed:  one Youden tau on the samples of all depths pooled, applied at every depth (if the pooled classes have
          >= min_samples_per_class samples each; otherwise nothing is gated).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from echo_vllm.core.atomic_file import atomic_write_text
from echo_vllm.errors import CalibrationError  # raised here, imported from here by the plugin and tests

SCHEMA_VERSION = 1
Mode = Literal["sparse", "dense", "fixed"]
MODES: tuple[str, ...] = get_args(Mode)


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------


def _as_samples(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.as_tensor(scores).reshape(-1).to(device="cpu", dtype=torch.float64)
    labels = torch.as_tensor(labels).reshape(-1).to(device="cpu")
    if scores.shape != labels.shape:
        raise ValueError(
            f"scores and labels must have the same number of samples; got {scores.numel()} and {labels.numel()}"
        )
    if torch.isnan(scores).any():
        raise ValueError("scores must not contain NaN")
    return scores, labels.to(torch.bool)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney AUC = P(pos > neg) + 0.5 P(pos == neg), by tie-averaged ranks; NaN if a class is empty."""
    scores, labels = _as_samples(scores, labels)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    counts = counts.to(torch.float64)
    start = torch.cumsum(counts, 0) - counts  # number of samples strictly below each unique value
    avg_rank = start + (counts + 1.0) / 2.0  # 1-based ranks averaged over the tie group
    rank_sum_pos = float(avg_rank[inverse][labels].sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def youden_threshold(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """tau maximizing J = TPR - FPR for "keep iff c >= tau", tau among the observed values.

    J is compared exactly (as the integer pos_ge * n_neg - neg_ge * n_pos), and among equal J the smallest tau
    wins. Raises ValueError if a class is empty.
    """
    scores, labels = _as_samples(scores, labels)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"youden_threshold needs both classes; got {n_pos} positive and {n_neg} negative samples")
    values, inverse = torch.unique(scores, sorted=True, return_inverse=True)
    pos = torch.zeros(values.numel(), dtype=torch.int64).index_add_(0, inverse, labels.to(torch.int64))
    neg = torch.zeros(values.numel(), dtype=torch.int64).index_add_(0, inverse, (~labels).to(torch.int64))
    pos_ge = torch.flip(torch.cumsum(torch.flip(pos, [0]), 0), [0])  # samples with c >= values[j]
    neg_ge = torch.flip(torch.cumsum(torch.flip(neg, [0]), 0), [0])
    j_scaled = pos_ge * n_neg - neg_ge * n_pos
    best = int(torch.argmax(j_scaled))  # first maximum = smallest tau (values ascending)
    return float(values[best])


# --------------------------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------------------------


class CalibrationRecorder:
    """Accumulates (c_{i,d}, accepted_{i,d}) samples per depth as tensors, without host syncs on `record`."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1; got {max_depth}")
        self.max_depth = max_depth
        self._chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_steps = 0

    def record(self, confidence: torch.Tensor, accepted_depth_mask: torch.Tensor, verified_depth: torch.Tensor) -> None:
        """Add one verification step.

        confidence [B, D] float (from `depth_confidence`), accepted_depth_mask [B, D'] bool (D' <= D, from
        VerifyResult; missing depths count as not reached), verified_depth [B] int: the deepest selected depth
        of each request (0 = nothing verified). Depth d of request i is recorded iff d <= verified_depth[i].
        """
        depth = self.max_depth
        if confidence.dim() != 2 or confidence.shape[1] != depth:
            raise ValueError(f"confidence must be [B, {depth}]; got {tuple(confidence.shape)}")
        batch = confidence.shape[0]
        if (
            accepted_depth_mask.dim() != 2
            or accepted_depth_mask.shape[0] != batch
            or accepted_depth_mask.shape[1] > depth
        ):
            raise ValueError(
                f"accepted_depth_mask must be [B={batch}, <= {depth}]; got {tuple(accepted_depth_mask.shape)}"
            )
        if verified_depth.shape != (batch,):
            raise ValueError(f"verified_depth must be [B={batch}]; got {tuple(verified_depth.shape)}")
        accepted = torch.zeros((batch, depth), dtype=torch.bool, device=confidence.device)
        accepted[:, : accepted_depth_mask.shape[1]] = accepted_depth_mask.to(torch.bool)
        depths = torch.arange(1, depth + 1, device=confidence.device)
        recorded = depths.unsqueeze(0) <= verified_depth.to(confidence.device).unsqueeze(1)
        self._chunks.append((confidence.detach().to(torch.float32), accepted, recorded))
        self.num_steps += 1

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._chunks:
            empty = torch.zeros((0, self.max_depth))
            return empty, empty.bool(), empty.bool()
        conf = torch.cat([c.cpu() for c, _, _ in self._chunks])
        acc = torch.cat([a.cpu() for _, a, _ in self._chunks])
        rec = torch.cat([r.cpu() for _, _, r in self._chunks])
        self._chunks = [(conf, acc, rec)]
        return conf, acc, rec

    def samples(self, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores float32, labels bool) on CPU for one depth (1-based), or pooled over all depths if None."""
        conf, acc, rec = self._merged()
        if depth is None:
            return conf[rec], acc[rec]
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth must be in 1..{self.max_depth}; got {depth}")
        col = depth - 1
        keep = rec[:, col]
        return conf[keep, col], acc[keep, col]

    def class_counts(self) -> tuple[list[int], list[int]]:
        """(accepted counts, rejected counts) per depth."""
        _, acc, rec = self._merged()
        pos = (acc & rec).sum(0)
        neg = (~acc & rec).sum(0)
        return [int(x) for x in pos], [int(x) for x in neg]


# --------------------------------------------------------------------------------------------------------------
# Calibration result
# --------------------------------------------------------------------------------------------------------------


def _float_or_none(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


@dataclass
class Calibration:
    """Gate parameters for depths 1..max_depth (list index d-1 is depth d).

    auc[d-1]: AUC_d or None (a class empty); tau[d-1]: threshold or None (not enough samples); gated[d-1]: whether
    depth d has a gate (then tau[d-1] is not None); num_pos/num_neg: accepted / rejected samples per depth.
    """

    mode: str
    max_depth: int
    delta: float
    auc: list[float | None]
    tau: list[float | None]
    gated: list[bool]
    num_pos: list[int]
    num_neg: list[int]
    min_samples_per_class: int = 1
    _cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _validate(self.to_json_dict(), source="Calibration")

    @property
    def sweet_spots(self) -> list[int]:
        """1-based gated depths."""
        return [d + 1 for d, g in enumerate(self.gated) if g]

    def gate_tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(gated [D] bool, tau [D] float32) on `device`, cached per device."""
        key = str(torch.device(device))
        if key not in self._cache:
            gated = torch.tensor(self.gated, dtype=torch.bool)
            tau = torch.tensor([t if t is not None else math.inf for t in self.tau], dtype=torch.float32)
            self._cache[key] = (gated.to(device), tau.to(device))
        return self._cache[key]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "mode": self.mode,
            "max_depth": self.max_depth,
            "delta": self.delta,
            "min_samples_per_class": self.min_samples_per_class,
            "auc": [_float_or_none(a) for a in self.auc],
            "tau": [_float_or_none(t) for t in self.tau],
            "gated": list(self.gated),
            "num_pos": list(self.num_pos),
            "num_neg": list(self.num_neg),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (`atomic_write_text`: replicas sharing a volume may all save at once)."""
        atomic_write_text(path, json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        expected_max_depth: int | None = None,
        expected_mode: str | None = None,
    ) -> Calibration:
        """Read a file written by `save`; any problem raises CalibrationError naming the file, field and fix."""
        path = Path(path)
        fix = "delete it to recalibrate during warm-up"
        try:
            text = path.read_text()
        except OSError as err:
            raise CalibrationError(f"calibration file {str(path)!r}: cannot be read ({err.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CalibrationError(
                f"calibration file {str(path)!r}: not valid JSON ({err.msg} at line {err.lineno}); {fix}"
            ) from None
        _validate(data, source=f"calibration file {str(path)!r}", fix=fix)
        if expected_max_depth is not None and data["max_depth"] != expected_max_depth:
            raise CalibrationError(
                f"calibration file {str(path)!r}: field 'max_depth' is {data['max_depth']} but this deployment drafts "
                f"{expected_max_depth} depths; {fix} (or point calibration_file elsewhere)"
            )
        if expected_mode is not None and data["mode"] != expected_mode:
            raise CalibrationError(
                f"calibration file {str(path)!r}: field 'mode' is {data['mode']!r} but gate_mode is "
                f"{expected_mode!r}; {fix} (or point calibration_file elsewhere)"
            )
        return cls(
            mode=data["mode"],
            max_depth=data["max_depth"],
            delta=float(data["delta"]),
            auc=list(data["auc"]),
            tau=list(data["tau"]),
            gated=list(data["gated"]),
            num_pos=list(data["num_pos"]),
            num_neg=list(data["num_neg"]),
            min_samples_per_class=data["min_samples_per_class"],
        )


Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Threshold = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
PER_DEPTH_FIELDS = ("auc", "tau", "gated", "num_pos", "num_neg")


class CalibrationFile(BaseModel):
    """The calibration file's schema (what `Calibration.to_json_dict` writes). Strict: JSON true is not 1."""

    model_config = ConfigDict(strict=True, extra="forbid")

    schema_version: Literal[1]
    mode: Mode
    max_depth: Annotated[int, Field(ge=1)]
    delta: Probability
    min_samples_per_class: Annotated[int, Field(ge=1)]
    auc: list[Probability | None]
    tau: list[Threshold | None]
    gated: list[bool]
    num_pos: list[Count]
    num_neg: list[Count]

    @model_validator(mode="after")
    def _per_depth_lists_agree(self) -> CalibrationFile:
        for key in PER_DEPTH_FIELDS:
            value = getattr(self, key)
            if len(value) != self.max_depth:
                raise PydanticCustomError(
                    "calibration",
                    f"field {key!r} must be a list of max_depth={self.max_depth} entries, got length {len(value)}",
                )
        for d, (g, t) in enumerate(zip(self.gated, self.tau, strict=True)):
            if g and t is None:
                raise PydanticCustomError("calibration", f"field 'tau' is null at depth {d + 1}, which is gated")
        return self


def _format_problem(problem: dict[str, Any]) -> str:
    """`field 'auc' entry 1: Input should be ...` from one pydantic error; a model check's own message as is."""
    loc = problem["loc"]
    if not loc:
        return problem["msg"]
    where = f"field {loc[0]!r}" + "".join(f" entry {p}" for p in loc[1:] if isinstance(p, int))
    if problem["type"] == "missing":
        return f"{where} is missing"
    if problem["type"] == "extra_forbidden":
        return f"{where} is unknown"
    return f"{where}: {problem['msg']} (got {problem['input']!r})"


def _validate(data: Any, source: str, fix: str = "fix the value") -> None:
    if not isinstance(data, dict):
        raise CalibrationError(f"{source}: must be a JSON object, got {type(data).__name__}; {fix}")
    try:
        CalibrationFile.model_validate(data)
    except ValidationError as err:
        first: dict[
            tuple[Any, ...], str
        ] = {}  # one problem per field: a wrong list of 4000 entries is one line, not 4000
        for problem in err.errors():
            first.setdefault(tuple(problem["loc"][:1]), _format_problem(dict(problem)))
        raise CalibrationError(f"{source}: {'; '.join(first.values())}; {fix}") from None


def calibrate(
    recorder: CalibrationRecorder,
    mode: str = "sparse",
    delta: float = 0.6,
    min_samples_per_class: int = 8,
) -> Calibration:
    """Per-depth AUC and Youden tau from the warm-up samples; gated depths by mode (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if min_samples_per_class < 1:
        raise ValueError(f"min_samples_per_class must be >= 1; got {min_samples_per_class}")
    depth = recorder.max_depth
    num_pos, num_neg = recorder.class_counts()
    aucs: list[float | None] = []
    taus: list[float | None] = []
    enough: list[bool] = []
    for d in range(1, depth + 1):
        scores, labels = recorder.samples(d)
        ok = num_pos[d - 1] >= min_samples_per_class and num_neg[d - 1] >= min_samples_per_class
        enough.append(ok)
        aucs.append(_float_or_none(auc(scores, labels)))
        taus.append(youden_threshold(scores, labels) if ok else None)
    if mode == "sparse":
        gated = [ok and a is not None and a > delta for ok, a in zip(enough, aucs, strict=True)]
    elif mode == "dense":
        gated = list(enough)
    else:
        scores, labels = recorder.samples(None)
        n_pos = int(labels.sum())
        if n_pos >= min_samples_per_class and labels.numel() - n_pos >= min_samples_per_class:
            shared = youden_threshold(scores, labels)
            taus = [shared] * depth
            gated = [True] * depth
        else:
            taus = [None] * depth
            gated = [False] * depth
    return Calibration(
        mode=mode,
        max_depth=depth,
        delta=float(delta),
        auc=aucs,
        tau=taus,
        gated=gated,
        num_pos=num_pos,
        num_neg=num_neg,
        min_samples_per_class=min_samples_per_class,
    )
