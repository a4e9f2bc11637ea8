"""The PNG of `bench vllm`: tokens/s (median, min-max bars) against batch size, one line per method.

EAGLE-3's depths are thin dashed lines and `eagle3-best` one solid line, so the tuned baseline reads at a glance.
Agg backend: no display on benchmark machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from echo_vllm.errors import InputError


def plot_throughput(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("tokens_per_s") is not None:
            lines.setdefault(row["label"], []).append(row)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in lines.items():
        points = sorted(points, key=lambda r: r["batch_size"])
        x = [p["batch_size"] for p in points]
        y = [p["tokens_per_s"] for p in points]
        low = [p["tokens_per_s"] - (p.get("tokens_per_s_min") or p["tokens_per_s"]) for p in points]
        high = [(p.get("tokens_per_s_max") or p["tokens_per_s"]) - p["tokens_per_s"] for p in points]
        thin = label.startswith("eagle3@")
        ax.errorbar(
            x,
            y,
            yerr=[low, high],
            label=label,
            marker="." if thin else "o",
            linestyle="--" if thin else "-",
            linewidth=0.8 if thin else 2.0,
            alpha=0.6 if thin else 1.0,
            capsize=3,
        )
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("tokens/s (median of rounds, min-max bars)")
    ax.set_title(title or "echo-vllm bench vllm")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise InputError(
            f"--plot {path}: cannot be written ({err.strerror}); give a path in a writable directory"
        ) from None
    finally:
        plt.close(fig)
    return Path(path)
