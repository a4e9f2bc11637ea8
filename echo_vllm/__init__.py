"""echo-vllm: ECHO elastic speculative decoding with sparse gating, as a vLLM plugin."""

__version__ = "0.1.0"
