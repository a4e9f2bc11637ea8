"""Benchmarks and their prompt sets, behind one command line: `echo-vllm bench hf|vllm|ops|verify-cost`.

cli (the `bench` subcommands), hf (the HF engine's methods at B = 1), ops (the budget op against its torch
reference), verify_cost (the K_max knee), datasets (prompt sets shipped in packages), report (the one table
printer and the JSON writer). `bench vllm` and `demo` (the interleaved protocol, docs/benchmarks.md): vllm_cli
(arguments and outputs), vllm_plan (variants, round order, prompts, warm-up), vllm_run (the rounds, one engine
process per job), vllm_rows (figures and rows), spread (median, min-max), vllm_table (the printed table),
oracle (the oracle bound), plot (the PNG), machine (CPU, threads, git commit). Nothing here is imported by the
method code or the vLLM plugin.
"""
