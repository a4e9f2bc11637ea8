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
  sparse: the checkpoints of the sweet spots that carry information of their own (below), each with its tau_d;
  auc:    every sweet spot D_sig = {d : AUC_d > delta and both classes have >= min_samples_per_class samples}
          (the paper's rule taken literally; sparse before schema 2);
  dense:  every depth with >= min_samples_per_class samples of both classes, each with its own tau_d (no AUC
          filter);
  fixed:  one Youden tau on the samples of all depths pooled, applied at every depth (if the pooled classes have
          >= min_samples_per_class samples each; otherwise nothing is gated).

The sparse rule. On the testbed (the HF engine's warm-up recorder, method echo, k_max 16, top_k 4, the first 20
HumanEval + 20 MT-Bench prompts, 96 new tokens each: 1168 request-steps at D = 6) every depth is a sweet spot (AUC 0.77 0.76 0.82 0.85 0.88 0.92 > 0.6), so `auc` gates all six depths and
is `dense`. AUC says a depth's confidence ranks its own acceptance well; it does not say that a gate there
changes anything the gates shallower than it have not already decided. A gate's effect is what it truncates:
a closed gate at depth d caps the request at d, so it removes the verified tokens at depths > d. On the warm-up
samples (row n = one request-step, rec[n, d] = depth d was verified, acc[n, d] = it was accepted) a gate set G
with thresholds tau_d caps row n at cap_n(G) = min{d in G : c[n, d] < tau_d} (D if none), and

  J(G) = #{(n, d) : rec, not acc, d > cap_n(G)} / N_rej  -  #{(n, d) : rec, acc, d > cap_n(G)} / N_acc

(N_acc, N_rej: recorded accepted / rejected tokens over all depths): the share of rejected draft tokens the gates
save minus the share of accepted ones they lose, i.e. Youden's J (the statistic that picks each tau_d) applied to
the gate set's keep/drop decisions on every recorded token. J({}) = 0; a gate at depth D truncates nothing.
Greedy forward selection over the sweet spots: repeatedly add the depth with the largest gain
J(G + {d}) - J(G) (ties: the shallowest), while the gain is >= min_gain and > 0 and |G| < max_gates. gain[d-1]
stores the gain each depth was judged by: a gated depth its gain when it was added, a sweet spot left out the
gain it would add to the final set; None for depths that are not sweet spots. On the testbed calibration above
the first gate is depth 2 (J 0.530 alone; depth 1 alone 0.349), then depth 4 adds 0.060, depth 3 would add
0.012, depth 5 0.004, depth 1 -0.007 (it truncates accepted tokens the depth-2 gate keeps) and depth 6 0:
gates at [2, 4], J 0.591, against 0.597 for all six (dense / auc). The same picks come out of the humaneval and
the mt-bench halves separately (at D = 8 the picks are [2, 3, 5]; the halves give [2, 4] and [2, 5]).
min_gain 0.02 is two points of J (about 67 of the 3359 rejected tokens here; the gains it turns down at D = 6
are 0.012 and below); max_gates 3 follows the paper's "root, target depth and select intermediate depths".
The tau_d stay each depth's own Youden threshold (the paper calibrates tau_d per checkpoint); the rule only
chooses where they apply.
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

SCHEMA_VERSION = 2  # 2 added max_gates, min_gain, gain, score (and mode "auc"); schema-1 files still load
SCHEMA_VERSIONS = (1, 2)
Mode = Literal["sparse", "auc", "dense", "fixed"]
MODES: tuple[str, ...] = get_args(Mode)
MAX_GATES = 3  # the sparse rule's defaults (EchoSettings.max_gates / min_gain); see the module docstring
MIN_GAIN = 0.02


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


def gate_set_j(
    confidence: torch.Tensor,
    accepted: torch.Tensor,
    recorded: torch.Tensor,
    gated: list[bool],
    tau: list[float | None],
) -> float:
    """J(G) of the module docstring: saved rejected share minus lost accepted share of the gate set's truncations.

    confidence [N, D], accepted [N, D] bool, recorded [N, D] bool (the recorder's rows); gated[d-1] / tau[d-1]
    as in `Calibration`. 0.0 if either class has no recorded token.
    """
    rows, depth = confidence.shape
    n_acc = int((accepted & recorded).sum())
    n_rej = int((~accepted & recorded).sum())
    if n_acc == 0 or n_rej == 0 or rows == 0:
        return 0.0
    gate = torch.tensor(gated, dtype=torch.bool)
    thresholds = torch.tensor([t if t is not None else -math.inf for t in tau], dtype=torch.float64)
    closed = gate.unsqueeze(0) & ~(confidence.to(torch.float64) >= thresholds.unsqueeze(0))
    depths = torch.arange(1, depth + 1)
    cap = torch.where(closed, depths, torch.full_like(depths, depth)).amin(dim=1)
    dropped = recorded & (depths.unsqueeze(0) > cap.unsqueeze(1))
    saved = int((dropped & ~accepted).sum())
    lost = int((dropped & accepted).sum())
    return saved / n_rej - lost / n_acc


def select_checkpoints(
    confidence: torch.Tensor,
    accepted: torch.Tensor,
    recorded: torch.Tensor,
    candidates: list[bool],
    tau: list[float | None],
    max_gates: int = MAX_GATES,
    min_gain: float = MIN_GAIN,
) -> tuple[list[bool], list[float | None], float]:
    """The sparse rule's greedy forward selection (module docstring): (gated, gain per depth, J of the set).

    Deterministic: J depends only on the multiset of rows, and ties go to the shallowest depth.
    """
    depth = len(candidates)
    gated = [False] * depth
    gain: list[float | None] = [None] * depth
    score = 0.0

    def gains() -> dict[int, float]:
        out = {}
        for d in range(depth):
            if candidates[d] and not gated[d]:
                trial = list(gated)
                trial[d] = True
                out[d] = gate_set_j(confidence, accepted, recorded, trial, tau) - score
        return out

    while True:
        trial_gains = gains()
        for d, g in trial_gains.items():
            gain[d] = g
        if not trial_gains or sum(gated) >= max_gates:
            break
        best = max(trial_gains, key=lambda d: (trial_gains[d], -d))
        if not (trial_gains[best] >= min_gain and trial_gains[best] > 0.0):
            break
        gated[best] = True
        score = gate_set_j(confidence, accepted, recorded, gated, tau)  # exact, not a sum of rounded gains
    return gated, gain, score


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

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(confidence [N, D] float32, accepted [N, D] bool, recorded [N, D] bool) on CPU: one row per
        request-step, every depth (the sparse rule needs each row's depths together)."""
        return self._merged()

    def class_counts(self) -> tuple[list[int], list[int]]:
        """(accepted counts, rejected counts) per depth."""
        _, acc, rec = self._merged()
        pos = (acc & rec).sum(0)
        neg = (~acc & rec).sum(0)
        return [int(x) for x in pos], [int(x) for x in neg]


# --------------------------------------------------------------------------------------------------------------
# Calibration result
# --------------------------------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _float_or_none(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


@dataclass
class Calibration:
    """Gate parameters for depths 1..max_depth (list index d-1 is depth d).

    auc[d-1]: AUC_d or None (a class empty); tau[d-1]: threshold or None (not enough samples); gated[d-1]: whether
    depth d has a gate (then tau[d-1] is not None); num_pos/num_neg: accepted / rejected samples per depth.
    Schema 2: max_gates / min_gain (sparse: the rule's settings, else None); gain[d-1] (sparse: the gain in J the
    rule judged depth d by, None where d is not a sweet spot; other modes: None); score: J of the gated set on the
    warm-up samples (None in schema-1 files).
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
    max_gates: int | None = None
    min_gain: float | None = None
    gain: list[float | None] | None = None
    score: float | None = None
    _cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _validate(self.to_json_dict(), source="Calibration")

    @property
    def sweet_spots(self) -> list[int]:
        """1-based gated depths."""
        return [d + 1 for d, g in enumerate(self.gated) if g]

    def describe(self) -> str:
        """One line: which depths are gated and why (the calibration log lines and `bench hf` print it), e.g.
        `sparse: gates at depths [2, 4] (AUC 0.76, 0.85; tau 0.0705, 0.0222; gain 0.530, 0.060), J 0.591;
        depths 1, 3, 5, 6 add -0.007, 0.012, 0.004, 0.000 < min_gain 0.02`."""
        depths = self.sweet_spots
        score = f", J {self.score:.3f}" if self.score is not None else ""
        if self.mode == "fixed":
            if not depths:
                return f"fixed: no gate (the pooled classes have < {self.min_samples_per_class} samples)"
            return f"fixed: one tau {self.tau[0]:.4g} at every depth 1..{self.max_depth}{score}"
        parts = [f"AUC {', '.join(_fmt(self.auc[d - 1], 2) for d in depths)}"]
        parts.append(f"tau {', '.join(f'{self.tau[d - 1]:.4g}' for d in depths)}")
        gain = self.gain if self.mode == "sparse" else None
        if gain is not None:
            parts.append(f"gain {', '.join(_fmt(gain[d - 1], 3) for d in depths)}")
        head = f"{self.mode}: gates at depths {depths}" + (f" ({'; '.join(parts)})" if depths else "") + score
        if self.mode == "sparse" and gain is None:
            return (
                f"{head}; a schema-1 file: every sweet spot (AUC > delta {self.delta}) is gated; delete it to "
                "recalibrate with the max_gates rule"
            )
        # why each other depth has no gate, grouped: (verb, template with {v} for the values) -> [(depth, value)]
        groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for d in range(1, self.max_depth + 1):
            if self.gated[d - 1]:
                continue
            a = self.auc[d - 1]
            if min(self.num_pos[d - 1], self.num_neg[d - 1]) < self.min_samples_per_class:
                key, value = ("have", f"< {self.min_samples_per_class} samples of a class"), ""
            elif self.mode == "dense":
                continue
            elif a is None or a <= self.delta:
                key, value = ("have", f"AUC {{v}} <= delta {self.delta}"), _fmt(a, 2)
            elif gain is not None and (g := gain[d - 1]) is not None:
                # left out because the cap was reached although it would add enough, or because it adds too little
                full = len(depths) >= (self.max_gates or 0) and g >= (self.min_gain or 0.0) and g > 0.0
                limit = f"(max_gates {self.max_gates} reached)" if full else f"< min_gain {self.min_gain}"
                key, value = ("add", f"{{v}} {limit}"), f"{g:.3f}"
            else:
                continue
            groups.setdefault(key, []).append((d, value))
        why = []
        for (verb, template), items in groups.items():
            many = len(items) > 1
            verb = verb if many else {"have": "has", "add": "adds"}[verb]
            listed = ", ".join(str(d) for d, _ in items)
            text = template.replace("{v}", ", ".join(v for _, v in items))
            why.append(f"{'depths' if many else 'depth'} {listed} {verb} {text}")
        return head + "".join(f"; {w}" for w in why)

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
            "max_gates": self.max_gates,
            "min_gain": _float_or_none(self.min_gain),
            "gain": None if self.gain is None else [_float_or_none(g) for g in self.gain],
            "score": _float_or_none(self.score),
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
            max_gates=data.get("max_gates"),
            min_gain=data.get("min_gain"),
            gain=data.get("gain"),
            score=data.get("score"),
        )


Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Threshold = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
PER_DEPTH_FIELDS = ("auc", "tau", "gated", "num_pos", "num_neg")


class CalibrationFile(BaseModel):
    """The calibration file's schema (what `Calibration.to_json_dict` writes). Strict: JSON true is not 1."""

    model_config = ConfigDict(strict=True, extra="forbid")

    schema_version: Literal[1, 2]  # SCHEMA_VERSIONS
    mode: Mode
    max_depth: Annotated[int, Field(ge=1)]
    delta: Probability
    min_samples_per_class: Annotated[int, Field(ge=1)]
    auc: list[Probability | None]
    tau: list[Threshold | None]
    gated: list[bool]
    num_pos: list[Count]
    num_neg: list[Count]
    # schema 2 (absent from schema-1 files, which load with them None)
    max_gates: Annotated[int, Field(ge=1)] | None = None
    min_gain: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    gain: list[Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False)] | None] | None = None
    score: Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _per_depth_lists_agree(self) -> CalibrationFile:
        if self.schema_version == 1 and self.mode == "auc":
            raise PydanticCustomError("calibration", "field 'mode' 'auc' needs schema_version 2")
        for key in (*PER_DEPTH_FIELDS, "gain"):
            value = getattr(self, key)
            if value is not None and len(value) != self.max_depth:
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
    max_gates: int = MAX_GATES,
    min_gain: float = MIN_GAIN,
) -> Calibration:
    """Per-depth AUC and Youden tau from the warm-up samples; gated depths by mode (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if min_samples_per_class < 1:
        raise ValueError(f"min_samples_per_class must be >= 1; got {min_samples_per_class}")
    if isinstance(max_gates, bool) or not isinstance(max_gates, int) or max_gates < 1:
        raise ValueError(f"max_gates must be an integer >= 1; got {max_gates!r}")
    if not (isinstance(min_gain, (int, float)) and 0.0 <= min_gain <= 1.0):
        raise ValueError(f"min_gain must be a number in [0, 1]; got {min_gain!r}")
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
    sweet = [ok and a is not None and a > delta for ok, a in zip(enough, aucs, strict=True)]
    rows = recorder.rows()
    gain: list[float | None] | None = None
    rule: dict[str, Any] = {}
    if mode == "sparse":
        gated, gain, _ = select_checkpoints(*rows, sweet, taus, max_gates, min_gain)
        rule = {"max_gates": max_gates, "min_gain": float(min_gain)}
    elif mode == "auc":
        gated = sweet
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
        gain=gain,
        score=gate_set_j(*rows, gated, taus),
        **rule,
    )
