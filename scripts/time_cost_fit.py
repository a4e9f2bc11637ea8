"""Per-call time of `fit_cost_model` (the proposer's refit, on the step path every 64-512 steps) on synthetic samples.

    PYTHONPATH=. python scripts/time_cost_fit.py [--sizes 100,300,600] [--calls 5] [--profile]

The samples look like the testbed's at batch 1-4: depth 0-4, rest 8 ms + 0.4 ms per token, draft 1 ms + 0.9 ms per
depth + 0.2 ms per drafted row, Gaussian noise, a prompt chunk now and then, seed 0. Each size: one untimed call,
then the mean of `--calls` calls (milliseconds), and the fitted per-token slope beside the planted one (a fit that
got faster by getting wrong shows here). `--profile`: cProfile's top functions of the largest size. The shared CPU
is noisy: run twice. Not a test, not a benchmark (docs/benchmarks.md quotes it: the forty-second session).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from echo_vllm.core.cost_model import CostModel, StepSample, fit_cost_model

REST_BASE_S = 8e-3
REST_TOKEN_S = 0.4e-3  # the planted per-token slope of the step outside the proposer
DRAFT_BASE_S = 1e-3
DRAFT_DEPTH_S = 0.9e-3
DRAFT_ROW_S = 0.2e-3


def synthetic_samples(count: int, seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        batch = rng.choice((1, 2, 3, 4))
        depth = rng.choice((0, 1, 2, 3, 4))
        verified = batch * depth
        num_tokens = batch + verified + rng.choice((0, 0, 0, 0, 16))
        rest = REST_BASE_S + REST_TOKEN_S * num_tokens + rng.gauss(0, 0.5e-3)
        draft = DRAFT_BASE_S + DRAFT_DEPTH_S * depth + DRAFT_ROW_S * batch * depth + rng.gauss(0, 0.2e-3)
        context = rng.randint(100, 3000)
        samples.append(
            StepSample(num_tokens, batch, depth, max(rest, 1e-4), max(draft, 0.0), verified=verified, context=context)
        )
    return samples


def token_slope(model: CostModel, low: float = 8.0, high: float = 24.0) -> float:
    """The fitted rest curve's seconds per token between `low` and `high` tokens (batch 1, no context)."""
    rest = model.rest_seconds(torch.tensor([low, high], dtype=torch.float64), batch=1)
    return float(rest[1] - rest[0]) / (high - low)


def time_fit(samples: list[StepSample], calls: int) -> tuple[float, CostModel]:
    """Milliseconds per call (the mean of `calls` after one untimed call) and the fitted model."""
    model = fit_cost_model(samples)
    assert model is not None
    start = time.perf_counter()
    for _ in range(calls):
        fit_cost_model(samples)
    return (time.perf_counter() - start) / calls * 1e3, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,300,600", help="sample counts, comma-separated")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest size")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"torch threads {torch.get_num_threads()}; planted slope {REST_TOKEN_S * 1e3:.3f} ms/token")
    for size in sizes:
        ms, model = time_fit(synthetic_samples(size), args.calls)
        print(f"{size:5d} samples: {ms:7.2f} ms per fit   fitted slope {token_slope(model) * 1e3:.3f} ms/token")
    if args.profile:
        samples = synthetic_samples(max(sizes))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            fit_cost_model(samples)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
