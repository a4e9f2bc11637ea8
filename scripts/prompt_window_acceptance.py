"""How the draft head's acceptance moves with `prompt_head_window`, at a fixed K_max (no timing in any decision).

    PYTHONPATH=. python scripts/prompt_window_acceptance.py --batch-size 4 --prompts 32 --windows 0,1,4,16

One offline vLLM job per window on the committed testbed (HumanEval prompts, 64 greedy tokens, K_max = batch x
depth: every draft a gate leaves open is verified), printing per window whether the output equals the first
window's, the engine steps, accepted drafts per verified draft and the prompt rows the head left out. Run it with
your own target and head (--target, --head) before turning the setting on without the cut rows' K/V
(`prompt_head_kv: false`, what this script runs unless --with-kv): the testbed head accepts more without its
prompt KV, a head trained on long contexts may accept less. With the K/V written (--with-kv; the default of the
setting) every window must show the first window's acceptance: the head's drafts do not change. Not a test, not
a benchmark (no timing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4, help="max_num_seqs")
    parser.add_argument("--prompts", type=int, default=32, help="HumanEval prompts")
    parser.add_argument("--windows", default="0,1,4,16", help="prompt_head_window values, the first the reference")
    parser.add_argument("--depth", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--target", default=str(ROOT / "tests/assets/testbed/target"))
    parser.add_argument("--head", default=str(ROOT / "tests/assets/testbed/eagle3"))
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--with-kv", action="store_true", help="write the cut rows' head K/V (prompt_head_kv)")
    args = parser.parse_args()

    from echo_vllm.bench.datasets import humaneval_prompts
    from echo_vllm.vllm.offline import run_in_subprocess

    prompts = humaneval_prompts(args.prompts)
    reference, rows = None, []
    for window in (int(w) for w in args.windows.split(",")):
        echo = {
            "k_max": args.batch_size * args.depth, "warmup_steps": 8, "prompt_head_window": window,
            "prompt_head_kv": args.with_kv,
        }  # fmt: skip
        job = {
            "model": args.target, "prompts": prompts, "max_tokens": args.max_tokens,
            "max_num_seqs": args.batch_size, "echo_stats": True,
            "speculative_config": {
                "method": "echo", "model": args.head, "num_speculative_tokens": args.depth, "echo": echo,
            },
        }  # fmt: skip
        result = run_in_subprocess(job)
        stats = result["echo_stats"]
        reference = result["token_ids"] if reference is None else reference
        row = {
            "prompt_head_window": window,
            "identical_to_first": result["token_ids"] == reference,
            "steps": stats["steps"],
            "accepted_per_verified_draft": round(stats["accepted_per_verified_draft"], 4),
            "prompt_rows_cut": stats["prompt_rows_cut"],
            "prompt_rows_kv": stats["prompt_rows_kv"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
