"""`echo-vllm soak`: a bounded soak of `vllm serve` with ECHO (docs/soak.md).

One job per module: `traffic` (seeded request mix, hostile kinds), `prompts` (prompt texts, near-limit prompts),
`client` (asyncio + httpx sender), `procs` (server processes, ports, memory), `checks`, `report`, `runner`
(the sequence), `config` and `cli`.
"""
