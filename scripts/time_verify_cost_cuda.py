"""Verification cost on a GPU with CUDA graphs: one Llama-3.1-8B-shaped decoder layer (random bfloat16 weights)
over B requests x T new tokens each, every request with `--context` tokens already cached (run on a GPU machine).

    PYTHONPATH=. python scripts/time_verify_cost_cuda.py [--context 1024] [--json out.json]

`echo-vllm bench verify-cost` times a Hugging Face forward eagerly: on a GPU its small-T times are kernel-launch
overhead, which vLLM's CUDA graphs remove. Here the layer (RMSNorm, fused QKV, attention of the new rows over
context + new keys by SDPA (flash), output projection, RMSNorm, SwiGLU MLP) is captured in a CUDA graph per
shape and replayed; the full model is estimated as 32 layers + the LM head (final norm + a 128256-row projection
of every row, as vLLM's verification computes logits for every verified position). RoPE is left out (elementwise, a
few microseconds); the new rows' K/V are written into the cache tensors in place. Two tables:

* the knee: B = 1, T = 1 ... 4096 (one request: the cost of T verified tokens);
* the load table: B requests x (1 + K) rows for K = 0 (plain decoding), 4 (a chain step of depth 4),
  8 and 16 (a spine-and-siblings tree of depth 4, top_k 4, verified whole): what a wide step costs per batch size.

Not a test, not an ECHO benchmark: the cost curve ECHO's budget would fit on this GPU.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from cuda_timing import graph_ms  # scripts/ is on sys.path when run as a script

HIDDEN, HEADS, KV_HEADS, HEAD, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32


class Layer:
    def __init__(self, gen: torch.Generator) -> None:
        def w(*shape: int) -> torch.Tensor:
            return torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) / shape[-1] ** 0.5

        self.qkv = w((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD)
        self.gate_up = w(2 * MLP, HIDDEN)
        self.down = w(HIDDEN, MLP)
        self.norm1 = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.norm2 = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]; k_all / v_all [B, Hkv, context + T, D]: the cache, whose last T slots this writes."""
        batch, rows, _ = x.shape
        h = F.rms_norm(x, (HIDDEN,), self.norm1, 1e-5)
        qkv = F.linear(h, self.qkv)
        q, k, v = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        # GQA as plain attention: a KV head's query heads are extra query rows over the same keys (so SDPA's flash
        # kernel runs; its enable_gqa path may fall back to the math kernel for some shapes).
        group = HEADS // KV_HEADS
        q = q.view(batch, rows, KV_HEADS, group, HEAD).permute(0, 2, 3, 1, 4).reshape(batch, KV_HEADS, -1, HEAD)
        k_all[:, :, -rows:] = k.view(batch, rows, KV_HEADS, HEAD).transpose(1, 2)  # the cache write, in place
        v_all[:, :, -rows:] = v.view(batch, rows, KV_HEADS, HEAD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k_all, v_all)  # [B, Hkv, group * rows, D]
        a = a.view(batch, KV_HEADS, group, rows, HEAD).permute(0, 3, 1, 2, 4).reshape(batch, rows, HEADS * HEAD)
        x = x + F.linear(a, self.o)
        h = F.rms_norm(x, (HIDDEN,), self.norm2, 1e-5)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


def step_ms(layer: Layer, head: torch.Tensor, batch: int, rows: int, context: int, gen: torch.Generator) -> dict:
    x = torch.randn((batch, rows, HIDDEN), device="cuda", generator=gen, dtype=torch.bfloat16)
    k_all = torch.randn((batch, KV_HEADS, context + rows, HEAD), device="cuda", generator=gen, dtype=torch.bfloat16)
    v_all = torch.randn_like(k_all)
    layer_ms = graph_ms(lambda: layer(x, k_all, v_all), replays=30)
    head_ms = graph_ms(lambda: F.linear(x, head), replays=30)
    return {
        "batch": batch,
        "rows_per_request": rows,
        "tokens": batch * rows,
        "layer_ms": layer_ms,
        "head_ms": head_ms,
        "est_full_ms": LAYERS * layer_ms + head_ms,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--knee-tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--batch-sizes", default="1,4,8,32,64,128,256")
    parser.add_argument("--drafts", default="0,4,8,16", help="K: draft rows per request besides its own")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_verify_cost_cuda: needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = Layer(gen)
    head = torch.randn((VOCAB, HIDDEN), device="cuda", generator=gen, dtype=torch.bfloat16) / HIDDEN**0.5
    knee = [step_ms(layer, head, 1, int(t), args.context, gen) for t in args.knee_tokens.split(",")]
    load = []
    for b in map(int, args.batch_sizes.split(",")):
        for k in map(int, args.drafts.split(",")):
            load.append({**step_ms(layer, head, b, 1 + k, args.context, gen), "drafts_per_request": k})
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, context {args.context}, bfloat16")
    base = knee[0]["est_full_ms"]
    print("| T (B=1) | layer ms | head ms | est. 32-layer step ms | x T=1 |")
    print("|---|---|---|---|---|")
    for r in knee:
        print(
            f"| {r['tokens']} | {r['layer_ms']:.4f} | {r['head_ms']:.4f} | {r['est_full_ms']:.3f} "
            f"| {r['est_full_ms'] / base:.2f} |"
        )
    print("| B | K drafts / request | tokens | est. step ms | x K=0 | ms per verified row |")
    print("|---|---|---|---|---|---|")
    plain = {r["batch"]: r["est_full_ms"] for r in load if r["drafts_per_request"] == 0}
    for r in load:
        ratio = r["est_full_ms"] / plain[r["batch"]]
        print(
            f"| {r['batch']} | {r['drafts_per_request']} | {r['tokens']} | {r['est_full_ms']:.3f} | {ratio:.2f} "
            f"| {r['est_full_ms'] / (r['batch'] * (1 + r['drafts_per_request'])):.4f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "context": args.context, "knee": knee, "load": load}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
