"""The draft-model drafter (issue #14): a plain small HF causal LM as the HF engine's drafter.

Tree expansion is checked against brute force (the draft LM re-run from scratch on context + each node's path),
every drafting method is lossless against `ar` with it on the shipped testbed, and a draft LM with another
vocabulary or tokenizer, or a bad --drafter spec, is one clear error.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from testbed_fixture import shipped_testbed
from transformers import LlamaConfig, LlamaForCausalLM

from echo_vllm.bench.datasets import humaneval_prompts, mtbench_prompts
from echo_vllm.bench.hf import encode_prompts, load_tokenizer
from echo_vllm.config import EchoSettings
from echo_vllm.core import grow_spine_siblings, grow_tree
from echo_vllm.core.eagle2 import DDDSettings, grow_eagle2
from echo_vllm.errors import InputError
from echo_vllm.hf.draft_model import DrafterError, DraftModelTreeDrafter, parse_drafter_spec
from echo_vllm.hf.engine import EngineInputError, EngineOptions, HFEngine

MAX_NEW = 24


def tiny_lm(vocab: int = 50, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


class Recording:
    """Wraps a drafter and keeps what each `expand` returned, per depth."""

    def __init__(self, drafter):
        self.inner = drafter
        self.vocab_size = drafter.vocab_size
        self.expanded: dict[int, torch.Tensor] = {}

    def root_logprobs(self):
        return self.inner.root_logprobs()

    def expand(self, tokens, slots, depth):
        out = self.inner.expand(tokens, slots, depth)
        self.expanded[depth] = out
        return out


@torch.no_grad()
def brute_force(model, context: list[int], path: list[int]) -> torch.Tensor:
    ids = torch.tensor([context + path])
    return torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)


def node_path(tree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(int(tree.tokens[0, node]))
        node = int(tree.parent[0, node])
    return path[::-1]


@pytest.mark.parametrize("grower", ["tree", "siblings", "eagle2"])
def test_tree_expansion_matches_brute_force(grower):
    """Every expanded node's children log-probs equal the draft LM run from scratch on context + its path, over
    several context extensions (so tree entries are dropped and the context grows between trees)."""
    model = tiny_lm()
    drafter = DraftModelTreeDrafter(model)
    prompt = [3, 17, 5, 9, 22, 41, 8]
    drafter.reset(torch.tensor([prompt]))
    # The engine's alignment: entry t at position t consumes token t + 1 (here the prompt's rest + one "pending").
    context = prompt + [11]
    drafter.extend_context(None, torch.tensor([context[1:]]), torch.arange(len(prompt)).unsqueeze(0))
    top_k, depth = 3, 4
    for accepted in ([4, 30], [7], [1, 2, 3]):
        torch.testing.assert_close(drafter.root_logprobs()[0], brute_force(model, context, []), atol=1e-4, rtol=0)
        rec = Recording(drafter)
        if grower == "tree":
            tree = grow_tree(rec, 1, depth, top_k)
            frontier = {d: [(d - 2) * top_k + j for j in range(top_k)] for d in range(2, depth + 1)}
        elif grower == "siblings":
            tree = grow_spine_siblings(rec, 1, depth, top_k)
            frontier = {d: [(d - 2) * top_k] for d in range(2, depth + 1)}
        else:
            pool = grow_eagle2(rec, 1, depth, top_k)
            tree = pool.tree
            frontier = {d: pool.frontier[0, d - 2].tolist() for d in range(2, depth + 1)}
        assert sorted(rec.expanded) == list(range(2, depth + 1))
        for d, nodes in frontier.items():
            for j, node in enumerate(nodes):
                expected = brute_force(model, context, node_path(tree, node))
                torch.testing.assert_close(rec.expanded[d][0, j], expected, atol=1e-4, rtol=0)
        # Accept some tokens (positions continue after the pending token, as the engine passes them).
        base = len(context) - 1
        drafter.extend_context(None, torch.tensor([accepted]), (base + torch.arange(len(accepted))).unsqueeze(0))
        context = context + accepted


def test_extend_context_needs_the_prompt():
    drafter = DraftModelTreeDrafter(tiny_lm())
    with pytest.raises(RuntimeError, match="reset"):
        drafter.extend_context(None, torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))


# ---- the engine with a draft LM, on the shipped testbed ------------------------------------------------------


@pytest.fixture(scope="module")
def root() -> Path:
    return shipped_testbed()


@pytest.fixture(scope="module")
def prompts(root) -> list[list[int]]:
    texts = humaneval_prompts(4) + mtbench_prompts(2)
    return encode_prompts(load_tokenizer(root / "target"), texts, max_prompt_tokens=96)


@pytest.fixture(scope="module")
def reference(root, prompts) -> list[list[int]]:
    engine = HFEngine(root / "target", None, EngineOptions(method="ar"))
    return [engine.generate(p, MAX_NEW).token_ids for p in prompts]


def draft_engine(root, method: str, settings: EchoSettings, max_depth: int = 5, **kw) -> HFEngine:
    options = EngineOptions(method=method, max_depth=max_depth, echo=settings, drafter="draft-model", **kw)
    return HFEngine(root / "target", root / "draft-lm", options)


def assert_identical(engine: HFEngine, prompts, reference, label: str) -> None:
    outputs = [engine.generate(p, MAX_NEW).token_ids for p in prompts]
    bad = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    assert not bad, f"{label}: prompts {bad[:5]} differ from ar"


@pytest.mark.parametrize(
    ("method", "settings", "ddd"),
    [
        ("chain", EchoSettings(k_max=16, top_k=4), None),
        ("eagle2", EchoSettings(k_max=12, top_k=3), None),
        ("ddd", EchoSettings(k_max=12, top_k=3), DDDSettings(threshold=-3.0, max_depth=6, check_depths=(2, 4))),
        ("siblings", EchoSettings(k_max=10, top_k=3), None),
        ("echo", EchoSettings(k_max=12, top_k=3, warmup_steps=6, min_samples_per_class=1), None),
    ],
)
def test_draft_model_greedy_identical_to_ar(root, prompts, reference, method, settings, ddd):
    engine = draft_engine(root, method, settings, ddd=ddd or DDDSettings())
    assert isinstance(engine.drafter, DraftModelTreeDrafter)
    assert engine.target.aux_layer_ids == ()  # a draft LM reads tokens, not the target's hidden states
    assert_identical(engine, prompts, reference, f"draft-model {method}")
    assert engine.metrics.summary()["mat"] > 1.0, "the draft LM never got a token accepted: the test proves little"
    if method == "echo":
        assert engine.calibration is not None, "warm-up should have ended and calibrated"


@pytest.mark.slow
def test_draft_model_echo_auto_greedy_identical(root, prompts, reference, tmp_path):
    """k_max 'auto' (the time-aware budget: profile, cost model, chooser) with the draft LM: lossless."""
    settings = EchoSettings(
        warmup_steps=6, min_samples_per_class=1, profile_steps=4, calibration_file=str(tmp_path / "cal.json")
    )
    engine = draft_engine(root, "echo", settings)
    assert_identical(engine, prompts, reference, "draft-model echo auto")
    assert engine.budget is not None and engine.budget.phase(engine.warming_up) == "auto"


def test_draft_model_shared_between_engines_stays_identical(root, prompts, reference):
    """The bench builds several methods on one drafter: they share the draft LM's weights, not its cache."""
    settings = EchoSettings(k_max=10, top_k=3, warmup_steps=4, min_samples_per_class=1)
    echo = draft_engine(root, "echo", settings, max_depth=4)
    eagle2 = HFEngine(
        root / "target",
        root / "draft-lm",
        EngineOptions(method="eagle2", max_depth=4, echo=settings, drafter="draft-model"),
        share_models_with=echo,
    )
    eagle3 = HFEngine(
        root / "target", root / "eagle3", EngineOptions(method="chain", max_depth=4), share_models_with=echo
    )
    ar = HFEngine(root / "target", None, EngineOptions(method="ar"), share_models_with=echo)
    assert eagle2.target is echo.target and ar.target is echo.target
    assert eagle2.drafter.model is echo.drafter.model and eagle2.drafter is not echo.drafter
    assert eagle3.target.aux_layer_ids != ()  # the head needs aux states: its own target, hooks installed
    for i in range(3):
        for engine in (echo, eagle3, ar, eagle2):
            assert engine.generate(prompts[i], MAX_NEW).token_ids == reference[i]


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 pooled into one (as tests/test_hf_engine.py)."""
    n = observed.sum()
    expected = expected_p.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.slow
def test_draft_model_sampling_first_spec_token_matches_target(root, prompts):
    """Sampling with the draft LM: the first token of a speculative step is distributed as the target's."""
    temperature, draws = 1.0, 1500
    engine = draft_engine(root, "eagle2", EchoSettings(k_max=10, top_k=4), max_depth=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pending = engine.prefill(prompts[0], 0.0, gen)
        ids = torch.tensor([prompts[0] + [pending]])
        target_p = torch.softmax(engine.target.model(input_ids=ids).logits[0, -1].float() / temperature, -1)
    target_state = copy.deepcopy(engine.target.cache)
    drafter_state = {k: copy.deepcopy(v) for k, v in vars(engine.drafter).items() if k != "model"}
    counts = torch.zeros_like(target_p, dtype=torch.long)
    for i in range(draws):
        engine.target.cache = copy.deepcopy(target_state)
        for k, v in drafter_state.items():
            setattr(engine.drafter, k, copy.deepcopy(v) if k == "cache" else v)
        first = engine.step(pending, temperature, torch.Generator().manual_seed(1000 + i))[0]
        counts[first] += 1
    assert chi2_pvalue(counts, target_p) > 1e-3


# ---- clear errors ------------------------------------------------------------------------------------------


def copy_draft(root: Path, dest: Path) -> Path:
    shutil.copytree(root / "draft-lm", dest)
    return dest


def test_unknown_drafter_names_the_field(root):
    with pytest.raises(EngineInputError, match="drafter: unknown 'medusa'.*eagle3, draft-model"):
        HFEngine(root / "target", root / "eagle3", EngineOptions(method="chain", drafter="medusa"))


def test_draft_vocab_mismatch_is_clear_error(root, tmp_path):
    other = tmp_path / "other"
    tiny_lm(vocab=64).save_pretrained(other, safe_serialization=True)
    shutil.copyfile(root / "target" / "tokenizer.json", other / "tokenizer.json")
    with pytest.raises(DrafterError, match=r"vocab_size 64.*has 4096.*share the target's tokenizer"):
        HFEngine(root / "target", other, EngineOptions(method="chain", drafter="draft-model"))


def test_draft_tokenizer_mismatch_is_clear_error(root, tmp_path):
    other = copy_draft(root, tmp_path / "other")
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # same size, two tokens' ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DrafterError, match="another tokenizer than the target"):
        HFEngine(root / "target", other, EngineOptions(method="chain", drafter="draft-model"))
    (other / "tokenizer.json").unlink()
    with pytest.raises(DrafterError, match=f"no tokenizer.json in {other}"):
        HFEngine(root / "target", other, EngineOptions(method="chain", drafter="draft-model"))


def test_missing_draft_model_is_clear_error(root, tmp_path):
    with pytest.raises(DrafterError, match="no draft model at"):
        HFEngine(root / "target", tmp_path / "nothing", EngineOptions(method="chain", drafter="draft-model"))


def test_parse_drafter_spec(tmp_path):
    assert parse_drafter_spec("eagle3", tmp_path) == ("eagle3", tmp_path / "eagle3")
    assert parse_drafter_spec("draft-model", tmp_path) == ("draft-model", tmp_path / "draft-lm")
    assert parse_drafter_spec("draft-model:/x/y", tmp_path) == ("draft-model", Path("/x/y"))
    for bad in ("draft", "draft-model:", "eagle-3:/x", ""):
        with pytest.raises(InputError, match="--drafter"):
            parse_drafter_spec(bad, tmp_path)
