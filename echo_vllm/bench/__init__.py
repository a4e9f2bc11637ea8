"""Benchmarks and their prompt sets, behind one command line: `echo-vllm bench hf|vllm|ops|verify-cost`.

cli (arguments, `bench vllm`, `demo`), hf (the HF engine's methods at B = 1), ops (the budget op against its
torch reference), verify_cost (the K_max knee), datasets (prompt sets shipped in packages), report (the one
table printer and the JSON writer). Nothing here is imported by the method code or the vLLM plugin.
"""
