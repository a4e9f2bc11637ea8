"""vLLM general-plugin entry point (`vllm.general_plugins: echo`).

Until the plugin issue lands this is deliberately a no-op: vLLM must behave exactly as without echo-vllm.
"""

from __future__ import annotations


def register() -> None:
    """Called by vLLM in every process that loads general plugins; changes nothing yet."""
    return None
