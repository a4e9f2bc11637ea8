"""vLLM general-plugin entry point (`vllm.general_plugins: echo = echo_vllm.vllm.plugin:register`).

vLLM calls `register()` in every process that loads general plugins (API server, EngineCore, workers, and the
main process of an in-process `LLM`). Without ECHO requested it must cost next to nothing and change nothing, so
it checks only what it can check without importing: the installed release and the hook rows of modules already
imported. Each patch of `echo_vllm.vllm.patches` goes in when its module is loaded (`post_import`): the
argument-level patches at once (vLLM calls register() from `vllm.engine.arg_utils`), the model runner's right
after vLLM imports the runner, which only workers do; the rows loaded by then are checked again first. Every
patch passes through to vLLM's own code unless ECHO is requested (EAGLE-3 and the rest behave exactly as without
echo-vllm). An ECHO request checks the whole table before anything runs: on the command line here, in
`EchoEngineConfigPatch` for an in-process `LLM`, and in `EchoDrafterPatch` when a worker builds ECHO's drafter.

On a version or hook mismatch no (further) patch goes in; if this process was started with an ECHO speculative
config on its command line (`vllm serve ... --speculative-config <echo config>`), it stops with one line naming
the version, the missing hooks and the fix; an ECHO request that arrives otherwise fails with that line too.
"""

from __future__ import annotations

import functools
import logging
import sys
from types import ModuleType
from typing import Any

from echo_vllm.vllm import hooks, post_import

logger = logging.getLogger("vllm.echo_vllm")

_state: dict[str, Any] = {"registered": False, "patches": []}  # also "refused" after a mismatch


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
    """Check what can be checked now; apply each patch when its vLLM module is loaded, or change nothing."""
    if _state.get("registered"):
        return
    _state["registered"] = True
    if _argv_requests_echo(sys.argv[1:]):
        # ECHO asked for on the command line: check the whole table now (this process's engine will need it)
        # and stop with one line on a mismatch; the imports are paid by ECHO runs only.
        report = hooks.check_hooks()
        if not report.ok:
            raise SystemExit(hooks.incompatibility_message(report))
        _patch_when_loaded()
        return
    report = hooks.check_loaded_hooks()  # the release, and the rows of modules this process has imported
    if not report.ok:
        _refuse(report)
        return
    _patch_when_loaded()


def _refuse(report: hooks.HookReport) -> None:
    """A mismatch without ECHO requested: no (further) patch in this process; vLLM runs as without the plugin."""
    _state["refused"] = True
    logger.warning("%s (ECHO disabled; vLLM runs unpatched)", hooks.incompatibility_message(report))


def _patch_when_loaded() -> None:
    """Each patch goes in when its module is loaded: at once for a module this process has imported already
    (vllm.engine.arg_utils, which calls register()), else right after vLLM imports it (the model runner, in a
    worker only). Just before, the rows of every module loaded by then are checked again."""
    from echo_vllm.vllm.patches import PATCHES

    by_module: dict[str, list[Any]] = {}
    for patch in PATCHES:
        by_module.setdefault(patch.hook.split(":")[0], []).append(patch)
    for module, patches in by_module.items():
        post_import.when_imported(module, functools.partial(_apply_on_load, patches))


def _apply_on_load(patches: list[Any], loaded: ModuleType) -> None:
    _apply(loaded.__name__, patches)


def _apply(module: str, patches: list[Any]) -> None:
    if _state.get("refused"):
        return
    report = hooks.check_loaded_hooks(just_loaded=[module])
    if not report.ok:
        _refuse(report)  # patches already in stay: they pass through, and an ECHO request checks everything first
        return
    for patch in patches:
        patch.apply()
        if patch.__name__ not in _state.setdefault("patches", []):
            _state["patches"].append(patch.__name__)
    logger.debug("echo-vllm patches applied: %s", ", ".join(p.__name__ for p in patches))


def applied_patches() -> list[str]:
    return list(_state["patches"])
