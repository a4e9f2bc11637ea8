"""EAGLE-2's draft pool as the official code builds it, and Dynamic Depth Decoding's stopping rule (issue #14).

Official EAGLE-2: `Model.topK_genrate` in SafeAILab/EAGLE, eagle/model/cnets.py (commit cb7e084). Per draft step it
  * expands the k frontier nodes and keeps each one's top k children: `cu_scores = topk_p + scores[:, None]`,
    k * k candidates with path score = parent path score + child log-prob;
  * appends **all** k * k candidates to the rerank pool (`scores_list.append(cu_scores)`,
    `ss_token.append(topk_index)`), not only the ones it keeps expanding;
  * takes the next frontier as the plain top k of the k * k candidates by path score
    (`topk_cs = torch.topk(cu_scores.view(-1), top_k)`, `out_ids = topk_cs_index // top_k` = the parent's frontier
    slot, `input_hidden = out_hidden[:, out_ids]`) - no slot is reserved for the best chain;
  * after `depth` such steps reranks the whole pool, the root's k children plus `depth * k * k` candidates, to the
    `total_tokens` best path scores (`torch.topk(scores_list, total_tokens)`, then sorted by pool index), with the
    parent of pool entry j at `parents_list[j // top_k]` (`parents = topk_cs_index + bias`).
Defaults in eagle/model/ea_model.py `EaModel.from_pretrained`: total_token=60, depth=7, top_k=10 (`total_token=-1`
picks total_tokens from timed candidates). So EAGLE-2's `depth` steps give a tree of depth + 1 levels: our
max_depth D is their depth + 1, and the pool has k + (D - 1) * k * k nodes.

The rerank is `echo_vllm.ops.select_eagle2(tree, total_tokens)`: every valid node competes on path score alone,
ties broken by depth ascending and then node index ascending. The pool's node index is the official pool order
(root block, then one k * k block per depth, candidate j * k + r = child r of frontier slot j), so ties go to the
lower official pool index. The official code takes `torch.topk` (ties in no specified order) and finds each
selected node's parent with a `searchsorted` that assumes the parent was selected too (the check that would catch
otherwise is commented out); it relies on a child never scoring above its parent. Here log-probs are clamped to
<= 0, so that holds, and an equal-score parent ranks first (shallower), so the selection is always ancestor-closed:
the same set as the official code wherever the official choice is determined.

Dynamic Depth Decoding (DDD; Brown, Wang, Do, Mathew, Yu, arXiv 2409.00142, "Dynamic Depth Decoding: Faster
Speculative Decoding for LLMs"): EAGLE-2's tree, but drafting stops early when the heuristic
H = log(sum_i exp(logprobsum[i])) over the w beam paths - here the log of the summed path probabilities of the k
frontier nodes - falls below a threshold; the check runs only at a few selected draft steps (sparse checks), with
up to n = 11 drafts and beam width w = 10 in the paper's setup. The paper's code was not found; the formula, the
sparse checks, n and w are from the paper (as summarised at sciencestack.ai/paper/2409.00142). Which steps are
checked and the threshold are settings here (`DDDSettings`), to be tuned (issue #14).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .tree import Drafter, DraftTree, _checked_root, _clean_logprobs, topk_stable


class Eagle2Pool(NamedTuple):
    """A grown pool: the tree, each depth's frontier and how deep drafting went.

    tree      DraftTree with N = k + (D - 1) * k * k nodes (see `grow_eagle2`).
    frontier  [B, D, k] int64 node index of frontier slot j at depth d (row d - 1), -1 for depths not drafted;
              the frontier of the deepest drafted depth is chosen but not expanded.
    depth     int, the deepest depth drafted (< D when `stop_after` stopped drafting).
    """

    tree: DraftTree
    frontier: torch.Tensor
    depth: int


def pool_size(max_depth: int, top_k: int) -> int:
    """Nodes in an EAGLE-2 pool of `max_depth` levels: k at depth 1, k * k at every deeper depth."""
    return top_k + (max_depth - 1) * top_k * top_k


def pool_depth_start(depth: int, top_k: int) -> int:
    """Index of the first node of `depth` (1-based) in the pool layout."""
    return 0 if depth == 1 else top_k + (depth - 2) * top_k * top_k


def grow_eagle2(
    drafter: Drafter,
    batch: int,
    max_depth: int,
    top_k: int,
    stop_after: Callable[[int, torch.Tensor], bool] | None = None,
) -> Eagle2Pool:
    """EAGLE-2's full draft pool (`topK_genrate`, see the module docstring), batched, no per-request loops.

    Layout (depth-major, parents before children): depth 1 = nodes 0..k-1, the top k root tokens in descending
    log-prob (ties: lower token id first, `topk_stable`); depth d > 1 = nodes s_d + j * k + r with
    s_d = k + (d - 2) * k * k, the r-th best child of frontier slot j of depth d - 1, so parent = that frontier
    node's index. Every expanded node's top k children are in the pool; siblings carry distinct tokens. The
    frontier of depth 1 is the k depth-1 nodes in slot order; the frontier of depth d > 1 is the top k of the
    depth's k * k candidates by path score (ties: lower candidate index j * k + r first), in descending score
    order; its nodes are what `drafter.expand` receives at the next depth, with `frontier_parent_slots` = the
    frontier slot of each one's parent (j), as `grow_tree` passes them.

    `spine` marks the best-child chain: node 0, then the best child (r = 0) of the previous spine node for as long
    as that node was in its depth's frontier (was expanded); a pure top-k frontier may drop it, and the chain ends.

    Log-probs are cleaned as in `grow_tree` (NaN -> -inf, clamped to <= 0); valid = finite score.
    `stop_after(depth, frontier_scores [B, k])`, if given, is asked after the frontier of each depth < max_depth is
    chosen whether to stop drafting (DDD's rule: `DDDSettings.stop_rule`); the depths not drafted are filled with
    invalid nodes, so the pool keeps its shape.
    """
    root = _checked_root(drafter, batch, max_depth, top_k)
    device = root.device
    num_cand = top_k * top_k
    scores, tokens = topk_stable(root, top_k)  # [B, k]: depth 1, which is also depth 1's frontier
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full((batch, top_k), -1, dtype=torch.int32, device=device)]
    all_spine = [torch.arange(top_k, device=device).eq(0).expand(batch, top_k)]
    frontier = torch.full((batch, max_depth, top_k), -1, dtype=torch.int64, device=device)
    frontier_nodes = torch.arange(top_k, device=device).expand(batch, top_k)  # node indices of the frontier
    frontier[:, 0] = frontier_nodes
    parent_slots = torch.zeros((batch, top_k), dtype=torch.int64, device=device)  # the root is slot 0 of depth 0
    spine_slot = torch.zeros((batch,), dtype=torch.int64, device=device)  # frontier slot of the spine node, or -1
    drafted = 1
    for depth in range(2, max_depth + 1):
        if stop_after is not None and stop_after(depth - 1, scores):
            break
        logp = _clean_logprobs(drafter.expand(tokens, parent_slots, depth))
        if logp.shape[:2] != (batch, top_k) or logp.dim() != 3:
            raise ValueError(f"expand must return [B={batch}, k={top_k}, V]; got {tuple(logp.shape)}")
        child_logp, child_tok = topk_stable(logp, top_k)  # [B, k, k]
        cand_scores = (scores.unsqueeze(2) + child_logp).reshape(batch, num_cand)
        cand_tokens = child_tok.reshape(batch, num_cand)
        cand_parent = frontier_nodes.repeat_interleave(top_k, dim=1)  # [B, k*k]: candidate j*k+r -> frontier j
        start = pool_depth_start(depth, top_k)
        has_spine = spine_slot >= 0
        spine_cand = spine_slot.clamp(min=0) * top_k  # the spine node's best child, r = 0
        cand_index = torch.arange(num_cand, device=device).expand(batch, num_cand)
        all_spine.append(has_spine.unsqueeze(1) & (cand_index == spine_cand.unsqueeze(1)))
        all_tokens.append(cand_tokens)
        all_scores.append(cand_scores)
        all_parents.append(cand_parent.to(torch.int32))
        # The next frontier: the plain top k of the k*k candidates (official: torch.topk(cu_scores.view(-1), k)).
        scores, pick = topk_stable(cand_scores, top_k)  # descending score, ties lower candidate index first
        tokens = torch.gather(cand_tokens, 1, pick)
        parent_slots = pick // top_k
        frontier_nodes = pick + start
        frontier[:, depth - 1] = frontier_nodes
        in_frontier = pick == spine_cand.unsqueeze(1)
        keeps_spine = has_spine & in_frontier.any(dim=1)
        spine_slot = torch.where(
            keeps_spine, in_frontier.to(torch.int64).argmax(dim=1), torch.full_like(spine_slot, -1)
        )
        drafted = depth
    for depth in range(drafted + 1, max_depth + 1):  # not drafted: invalid nodes under the previous block
        prev = pool_depth_start(depth - 1, top_k)
        all_tokens.append(torch.zeros((batch, num_cand), dtype=torch.int64, device=device))
        all_scores.append(torch.full((batch, num_cand), float("-inf"), dtype=torch.float32, device=device))
        parents = prev + torch.arange(num_cand, device=device, dtype=torch.int32) // top_k
        all_parents.append(parents.expand(batch, num_cand))
        all_spine.append(torch.zeros((batch, num_cand), dtype=torch.bool, device=device))
    tree_scores = torch.cat(all_scores, dim=1)
    depth_row = torch.cat(
        [torch.full((top_k,), 1, dtype=torch.int32, device=device)]
        + [torch.full((num_cand,), d, dtype=torch.int32, device=device) for d in range(2, max_depth + 1)]
    )
    tree = DraftTree(
        tokens=torch.cat(all_tokens, dim=1),
        scores=tree_scores,
        parent=torch.cat(all_parents, dim=1).contiguous(),
        depth=depth_row.expand(batch, -1).contiguous(),
        valid=torch.isfinite(tree_scores),
        spine=torch.cat(all_spine, dim=1).contiguous(),
    )
    return Eagle2Pool(tree, frontier, drafted)


def grow_eagle2_pool(
    drafter: Drafter,
    batch: int,
    max_depth: int,
    top_k: int,
    stop_after: Callable[[int, torch.Tensor], bool] | None = None,
) -> DraftTree:
    """The tree of `grow_eagle2` (N = k + (max_depth - 1) * k * k nodes)."""
    return grow_eagle2(drafter, batch, max_depth, top_k, stop_after).tree


def beam_log_mass(frontier_scores: torch.Tensor) -> torch.Tensor:
    """DDD's heuristic H [B] = log(sum over the frontier of exp(path score)); -inf for an empty/invalid beam."""
    return torch.logsumexp(frontier_scores.to(torch.float32), dim=-1)


@dataclass(frozen=True)
class DDDSettings:
    """Dynamic Depth Decoding's knobs (arXiv 2409.00142).

    threshold     stop deepening when H = log(summed path probabilities of the frontier) < threshold (<= 0:
                  H <= log 1 = 0 always);
    max_depth     the deepest depth drafted when H never falls below the threshold (the paper: n = 11 drafts);
    check_depths  the depths (of the frontier checked; 1..max_depth - 1) at which H is tested - the paper checks
                  only at a few draft steps; which ones is our choice (4, 6, 8): the paper's text was not reachable
                  from here, only its summary (the rule, the beam sum, n = 11).
    These defaults are the engine's when nothing else is given; `echo-vllm bench hf` runs ddd at the threshold its
    sweep chose on the tuning prompts (echo_vllm/bench/hf_tuned.json: -2 on the CPU testbed, where the frontier's
    H has a median of about -4.6 at depth 4 and -6.9 at depth 6).
    """

    threshold: float = -4.0
    max_depth: int = 10
    check_depths: tuple[int, ...] = (4, 6, 8)

    def problems(self) -> list[str]:
        """One line per bad field, naming it and the fix; empty when the settings are usable."""
        out = []
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t > 0:
            out.append(
                f"ddd.threshold must be a finite number <= 0 (the log of the beam's summed path probability, "
                f"which is <= 0); got {t!r}"
            )
        d = self.max_depth
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            out.append(f"ddd.max_depth must be an integer >= 1; got {d!r}")
            return out
        checks = self.check_depths
        ok = isinstance(checks, (tuple, list)) and all(
            isinstance(c, int) and not isinstance(c, bool) and 1 <= c < d for c in checks
        )
        if not ok:
            out.append(
                f"ddd.check_depths must be integers in 1..{d - 1} (ddd.max_depth - 1; a check at the last depth "
                f"cannot stop anything); got {checks!r}"
            )
        return out

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    def should_stop(self, depth: int, frontier_scores: torch.Tensor) -> bool:
        """DDD's rule after the frontier of `depth` is chosen: stop iff `depth` is checked and H < threshold for
        every request (B = 1 in the HF engine; a batch stops only once every request would). One host sync."""
        if depth not in self.check_depths:
            return False
        return bool((beam_log_mass(frontier_scores) < self.threshold).all())
