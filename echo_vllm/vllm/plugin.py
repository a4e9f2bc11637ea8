"""vLLM general-plugin entry point (`vllm.general_plugins: echo = echo_vllm.vllm.plugin:register`).

vLLM calls `register()` in every process that loads general plugins (API server, EngineCore, workers, and the
main process of an in-process `LLM`). It checks the hook table against the pinned vLLM and, if everything
resolves, applies the named patches of `echo_vllm.vllm.patches`. Without ECHO requested, every patch passes
through to vLLM's own code (EAGLE-3 and the rest behave exactly as without echo-vllm).

On a version or hook mismatch nothing is patched; if this process was started with an ECHO speculative config
on its command line (`vllm serve ... --speculative-config <echo config>`), it stops with one line naming the
version, the missing hooks and the fix. (An in-process `LLM(..., speculative_config={"method": "echo"})` then
gets vLLM's own rejection of the unknown method, after the warning logged here.)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from echo_vllm.vllm import hooks

logger = logging.getLogger("vllm.echo_vllm")

_state: dict[str, Any] = {"registered": False, "patches": []}


def _argv_requests_echo(argv: list[str]) -> bool:
    from echo_vllm.vllm import spec as echo_spec

    for i, arg in enumerate(argv):
        value = None
        if arg in ("--speculative-config", "-sc") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--speculative-config="):
            value = arg.split("=", 1)[1]
        elif arg in ("--speculative-config.method", "-sc.method") and i + 1 < len(argv):
            if argv[i + 1] == echo_spec.ECHO_METHOD:
                return True
        elif arg.startswith(("--speculative-config.method=", "-sc.method=")):
            if arg.split("=", 1)[1] == echo_spec.ECHO_METHOD:
                return True
        if value is not None:
            try:
                if echo_spec.is_echo_request(echo_spec.load_spec(value)):
                    return True
            except Exception:  # noqa: BLE001 - unparsable here: vLLM reports it
                continue
    return False


def register() -> None:
    """Check hooks; apply the patches or (on mismatch) change nothing."""
    if _state["registered"]:
        return
    report = hooks.check_hooks()
    if not report.ok:
        message = hooks.incompatibility_message(report)
        if _argv_requests_echo(sys.argv[1:]):
            raise SystemExit(message)
        logger.warning("%s (ECHO disabled; vLLM runs unpatched)", message)
        _state["registered"] = True
        return
    from echo_vllm.vllm.patches import apply_patches

    _state["patches"] = apply_patches()
    _state["registered"] = True
    logger.debug("echo-vllm patches applied: %s", ", ".join(_state["patches"]))


def applied_patches() -> list[str]:
    return list(_state["patches"])
