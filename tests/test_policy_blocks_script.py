"""scripts/policy_blocks.py's step attribution: decode steps only by default, steps with prompt rows on request."""

from __future__ import annotations

from script_module import load_script


def _line(policy, depth, num_tokens, verified, accepted, rest, draft):
    return {
        "phase": "auto", "policy": policy, "batch": 2, "drafted_depth": depth, "num_tokens": num_tokens,
        "verified_in_forward": verified, "accepted": accepted, "rest_s": rest, "draft_s": draft,
    }  # fmt: skip


def test_steps_with_prompt_rows_count_only_on_request():
    blocks = load_script("policy_blocks")
    lines = [
        _line("static:1", 1, 2, 0, [], 0.01, 0.001),
        _line("static:1", 1, 4, 2, [1, 0], 0.02, 0.002),  # decode: 2 requests + 2 verified drafts
        _line("static:2", 2, 40, 2, [1, 1], 0.05, 0.003),  # 36 prompt rows in this forward
        _line("static:2", 2, 6, 4, [2, 0], 0.03, 0.004),
    ]
    decode = blocks.decode_steps(lines)
    every = blocks.decode_steps(lines, with_prompts=True)
    assert len(every) == len(decode) + 1
    # The step with prompt rows is the previous line's policy's, with batch + accepted tokens.
    assert ("static:1", 4.0) in [(p, e) for p, _, e, _, _ in every]
    assert ("static:1", 4.0) not in [(p, e) for p, _, e, _, _ in decode]
