"""Does a request's own recent acceptance predict its next drafts' acceptance beyond the draft confidence? (#12)

    PYTHONPATH=. python scripts/acceptance_history.py capture --batch 16 --limit 164 --max-tokens 128 --out F.jsonl
    python scripts/acceptance_history.py analyze F.jsonl [--alpha 0.3]

`capture` runs one ECHO job on the CPU testbed, built as `echo-vllm bench vllm` builds it, whose calibration
warm-up never ends: every step verifies every request's full depth-D chain, so no gate or budget censors what is
accepted. It writes one JSON line per verified request-step: the request id, its depth confidences c_1..c_D (the
cumulative draft probabilities ECHO's gates and acceptance table read) and how many drafts the target accepted.

`analyze` asks what ECHO's acceptance model could gain from one more feature, the request's exponentially
averaged accepted length over its previous steps (`--alpha`): per depth, the ROC AUC of the confidence and of the
history for "the depth-d draft was accepted"; then, fitted on half of the requests and scored on the other half,
a table of P(accepted | depth, confidence bin) against one of P(accepted | depth, confidence bin, history
quartile), each used to pick the same number of drafts per step across the batch (best predicted first, a chain's
prefix at a time): the accepted drafts each picks. A gain there is the selection's gain at an equal verification
cost. `--online` adds what the engine's `request_history` does (twenty-fourth session): each step, the drafts
picked by the table's P(accepted | depth, confidence bin) times the request's factor (accepted + prior) /
(expected + prior), the averages (weight `--alpha`) updated from the picked drafts only - the censored view the
engine has - against the table alone at the same budget. Reporting only; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo_vllm.core.calibration import auc as calibration_auc

BUDGET_FRACTIONS = (0.125, 0.25, 0.375, 0.5)  # drafts picked per step, as a fraction of the B x D drafted
CONF_BINS = 12  # confidence bins over six decades (1 .. 1e-6), as fine as the acceptance table's
PRIOR = 5.0  # pseudo-counts shrinking a (depth, confidence, history) cell to its (depth, confidence) rate


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """The calibration's ROC AUC (ECHO's sweet-spot criterion: ties count half), on numpy arrays."""
    return calibration_auc(torch.as_tensor(score, dtype=torch.float64), torch.as_tensor(label, dtype=torch.bool))


def history(records: Sequence[dict[str, Any]], alpha: float, depth: int) -> np.ndarray:
    """Per record: the request's accepted-length average over its earlier records (NaN for its first)."""
    state: dict[str, float] = {}
    out = np.full(len(records), np.nan)
    for i, record in enumerate(records):
        previous = state.get(record["req"])
        if previous is not None:
            out[i] = previous
        accepted = min(int(record["acc"]), depth)
        state[record["req"]] = accepted if previous is None else (1.0 - alpha) * previous + alpha * accepted
    return out


def _conf_bins(confidence: np.ndarray) -> np.ndarray:
    decades = np.clip(-np.log10(np.maximum(confidence, 1e-12)), 0.0, 5.999)
    return (decades / 6.0 * CONF_BINS).astype(int)


def fitted_rates(conf: np.ndarray, hist_bin: np.ndarray, accepted: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """P(the depth-d draft is accepted) for every record, from the `fit` records' counts per (depth, confidence bin,
    history bin), shrunk towards the (depth, confidence bin) rate; a chain's rates are capped by its parent's."""
    depth = conf.shape[1]
    bins = _conf_bins(conf)
    num_hist = int(hist_bin.max()) + 1
    rates = np.zeros(conf.shape)
    for d in range(depth):
        hit = (accepted > d).astype(float)
        seen = np.zeros((CONF_BINS, num_hist))
        won = np.zeros((CONF_BINS, num_hist))
        np.add.at(seen, (bins[fit, d], hist_bin[fit]), 1.0)
        np.add.at(won, (bins[fit, d], hist_bin[fit]), hit[fit])
        pooled = (won.sum(axis=1) + 1.0) / (seen.sum(axis=1) + 2.0)
        cell = (won + PRIOR * pooled[:, None]) / (seen + PRIOR)
        rates[:, d] = cell[bins[:, d], hist_bin]
    return np.minimum.accumulate(rates, axis=1)


def picked_accepted(rates: np.ndarray, accepted: np.ndarray, steps: np.ndarray, fraction: float) -> tuple[int, int]:
    """(drafts verified, drafts accepted) when each step verifies its round(fraction x B x D) best-rated drafts."""
    depth = rates.shape[1]
    verified = won = 0
    for step in np.unique(steps):
        rows = np.flatnonzero(steps == step)
        take = int(round(fraction * rows.size * depth))
        if take == 0:
            continue
        best = np.argsort(-rates[rows], axis=None, kind="stable")[:take]
        counts = np.zeros(rows.size, dtype=int)
        np.maximum.at(counts, best // depth, best % depth + 1)  # rates fall along a chain: a prefix per row
        verified += int(counts.sum())
        won += int(np.minimum(accepted[rows], counts).sum())
    return verified, won


def _pick(rates: np.ndarray, take: int) -> np.ndarray:
    """Per row, how many drafts of its chain the `take` best-rated drafts of the step include (a prefix per row)."""
    depth = rates.shape[1]
    best = np.argsort(-rates, axis=None, kind="stable")[:take]
    counts = np.zeros(rates.shape[0], dtype=int)
    np.maximum.at(counts, best // depth, best % depth + 1)
    return counts


def online_factor(
    records: Sequence[dict[str, Any]], alpha: float, prior: float = 2.0, fractions: Sequence[float] = BUDGET_FRACTIONS
) -> list[dict[str, Any]]:
    """The engine's request history replayed: per half of the requests (the table fitted on the other half), per
    budget fraction, accepted drafts of the table's picks against the picks by table x factor, the factor's
    averages fed only by what was picked (accepted drafts, the table's expectation of them)."""
    conf = np.array([r["conf"] for r in records], dtype=float)
    depth = conf.shape[1]
    accepted = np.array([min(int(r["acc"]), depth) for r in records])
    steps = np.array([int(r["step"]) for r in records])
    reqs = [r["req"] for r in records]
    half = np.array([sum(map(ord, r)) % 2 for r in reqs])
    rows_out = []
    for test in (0, 1):
        table = fitted_rates(conf, np.zeros(len(records), dtype=int), accepted, half != test)
        scored = np.flatnonzero(half == test)
        for fraction in fractions:
            totals = {"plain": [0, 0], "factor": [0, 0]}
            for mode in totals:
                averages: dict[str, list[float]] = {}
                for step in np.unique(steps[scored]):
                    rows = scored[steps[scored] == step]
                    take = int(round(fraction * rows.size * depth))
                    if take == 0:
                        continue
                    p = table[rows]
                    if mode == "factor":
                        pairs = [averages.get(reqs[r], [0.0, 0.0]) for r in rows]
                        factor = np.array([(a + prior) / (e + prior) for a, e in pairs])
                        p = np.minimum.accumulate(np.minimum(p * factor[:, None], 1.0), axis=1)
                    counts = _pick(p, take)
                    won = np.minimum(accepted[rows], counts)
                    totals[mode][0] += int(counts.sum())
                    totals[mode][1] += int(won.sum())
                    for j, r in enumerate(rows):
                        if counts[j]:
                            a, e = averages.get(reqs[r], [0.0, 0.0])
                            expected = float(table[r, : counts[j]].sum())
                            averages[reqs[r]] = [(1 - alpha) * a + alpha * won[j], (1 - alpha) * e + alpha * expected]
            plain, factor = totals["plain"], totals["factor"]
            rows_out.append({"half": test, "fraction": fraction, "verified": plain[0], "accepted_table": plain[1],
                             "verified_factor": factor[0], "accepted_factor": factor[1],
                             "gain": factor[1] / plain[1] - 1.0 if plain[1] else float("nan")})  # fmt: skip
    return rows_out


def analyze(records: Sequence[dict[str, Any]], alpha: float) -> dict[str, Any]:
    conf = np.array([r["conf"] for r in records], dtype=float)
    depth = conf.shape[1]
    accepted = np.array([min(int(r["acc"]), depth) for r in records])
    past = history(records, alpha, depth)
    past = np.where(np.isnan(past), np.nanmean(past) if np.isfinite(past).any() else 0.0, past)
    edges = np.quantile(past, [0.25, 0.5, 0.75])
    hist_bin = np.digitize(past, edges)
    steps = np.array([int(r["step"]) for r in records])
    half = np.array([sum(map(ord, r["req"])) % 2 for r in records])  # a split by request, stable across runs
    out: dict[str, Any] = {"records": len(records), "alpha": alpha, "mean_accepted": float(accepted.mean())}
    out["auc"] = [
        {"depth": d + 1, "p": float((accepted > d).mean()), "confidence": auc(conf[:, d], accepted > d),
         "history": auc(past, accepted > d)}
        for d in range(depth)
    ]  # fmt: skip
    out["history_corr"] = float(np.corrcoef(past, accepted)[0, 1]) if len(records) > 2 else float("nan")
    rows = []
    for test in (0, 1):
        fit, scored = half != test, half == test
        plain = fitted_rates(conf, np.zeros_like(hist_bin), accepted, fit)
        with_history = fitted_rates(conf, hist_bin, accepted, fit)
        for fraction in BUDGET_FRACTIONS:
            v0, a0 = picked_accepted(plain[scored], accepted[scored], steps[scored], fraction)
            v1, a1 = picked_accepted(with_history[scored], accepted[scored], steps[scored], fraction)
            rows.append({"half": test, "fraction": fraction, "verified": v0, "accepted_confidence": a0,
                         "verified_history": v1, "accepted_history": a1,
                         "gain": a1 / a0 - 1.0 if a0 else float("nan")})  # fmt: skip
    out["selection"] = rows
    return out


def _child() -> int:
    """The job (stdin) with the feedback wrapped: each verified request-step of the never-ending warm-up."""
    from echo_vllm.core.calibration import CalibrationRecorder
    from echo_vllm.vllm import offline, proposer

    job = json.loads(sys.stdin.read())
    sink = open(os.environ["ECHO_ACCEPTANCE_OUT"], "w")
    cls = proposer.EchoProposer
    observe, rows_of, record = cls._observe, cls._verified_rows, CalibrationRecorder.record
    seen: dict[str, Any] = {"step": 0}

    def rows(*a: Any, **k: Any) -> Any:
        seen["rows"] = rows_of(*a, **k)
        return seen["rows"]

    def recorded(self: Any, confidence: Any, mask: Any, verified_depth: Any) -> None:
        seen["record"] = (confidence.tolist(), mask.sum(dim=1).tolist())
        record(self, confidence, mask, verified_depth)

    def observed(self: Any, req_ids: Any, sampled: Any, meta: Any) -> None:
        pending, seen["rows"], seen["record"] = self._pending, None, None
        observe(self, req_ids, sampled, meta)
        seen["step"] += 1
        if pending is None or seen["rows"] is None or seen["record"] is None:
            return
        conf, acc = seen["record"]
        for j, old in enumerate(seen["rows"][1].tolist()):
            line = {"step": seen["step"], "req": pending.req_ids[old], "conf": conf[j], "acc": int(acc[j])}
            sink.write(json.dumps(line) + "\n")

    cls._verified_rows = staticmethod(rows)  # type: ignore[method-assign]
    cls._observe = observed  # type: ignore[method-assign]
    CalibrationRecorder.record = recorded  # type: ignore[method-assign]
    offline.run_job(job)
    sink.close()
    return 0


def capture(args: argparse.Namespace) -> int:
    from echo_vllm.bench.vllm_cli import plan_from_args
    from echo_vllm.bench.vllm_run import build_job
    from echo_vllm.runtime_env import cpu_runtime_env

    ns = argparse.Namespace(
        methods="echo-auto", eagle3_depths=[args.depth], depth=args.depth, top_k=4, k_max="auto", warmup_steps=16,
        profile_steps=30, surplus_tail=True, dataset="humaneval", testbed=None, limit=args.limit,
        max_tokens=args.max_tokens, batch_sizes=[args.batch], rounds=1,
    )  # fmt: skip
    plan = plan_from_args(ns)
    work = Path(args.out).resolve().parent / "acceptance-history-work"
    work.mkdir(parents=True, exist_ok=True)
    job, env_extra = build_job(plan, plan.variants[-1], args.batch, work, profile_key=True)
    job["speculative_config"]["echo"]["warmup_steps"] = 10**9  # never calibrated: every chain verified whole
    env = cpu_runtime_env(os.environ, in_process=True)
    env.update(env_extra)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    env["ECHO_ACCEPTANCE_OUT"] = str(Path(args.out).resolve())
    from echo_vllm.runtime_env import job_temp_dir

    with job_temp_dir(env) as job_env:  # vLLM's IPC sockets and temp files go with the job
        proc = subprocess.run(
            [sys.executable, __file__, "--child"], input=json.dumps(job), text=True, env=job_env, capture_output=True
        )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
    return proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("--batch", type=int, default=16)
    cap.add_argument("--limit", type=int, default=164)
    cap.add_argument("--max-tokens", type=int, default=128)
    cap.add_argument("--depth", type=int, default=4)
    cap.add_argument("--out", required=True)
    ana = sub.add_parser("analyze")
    ana.add_argument("records", type=Path)
    ana.add_argument("--alpha", type=float, default=0.3)
    ana.add_argument("--online", action="store_true", help="also replay the engine's request_history factor")
    args = parser.parse_args(argv)
    if args.command == "capture":
        return capture(args)
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    print(report(analyze(records, args.alpha)))
    if args.online:
        for row in online_factor(records, args.alpha):
            print(
                f"  online half {row['half']} budget {row['fraction']:.3f}: accepted {row['accepted_table']} of "
                f"{row['verified']} (table) vs {row['accepted_factor']} of {row['verified_factor']} (x request "
                f"factor): {row['gain']:+.3f}"
            )
    return 0


def report(result: dict[str, Any]) -> str:
    """The analysis as text: per-depth AUCs, then the selection at each budget (both halves)."""
    lines = [
        f"{result['records']} request-steps, mean accepted {result['mean_accepted']:.2f}, "
        f"history (alpha {result['alpha']}) vs accepted: r = {result['history_corr']:.2f}"
    ]
    for row in result["auc"]:
        lines.append(
            f"  depth {row['depth']}: P(accepted) {row['p']:.3f}  AUC confidence {row['confidence']:.3f}"
            f"  history {row['history']:.3f}"
        )
    for row in result["selection"]:
        lines.append(
            f"  half {row['half']} budget {row['fraction']:.3f}: verified {row['verified']}, accepted "
            f"{row['accepted_confidence']} (confidence) vs {row['accepted_history']} (+ history): {row['gain']:+.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
