"""Nothing of vLLM changes, and next to nothing is paid, when ECHO is not requested: register() imports no vLLM
module, each patch goes in when vLLM loads its module, and a hook drift in a module loaded later is still caught
before that module's patches go in. Each case runs in a fresh interpreter (what is imported is the point).

Time is too noisy on a shared CI machine to bound; modules are not. The bound: register() may load only
echo-vllm's own plugin modules (15 today: plugin, hooks, patches, post_import, spec, config, combinations, ...);
MAX_NEW_MODULES leaves room for a few more small ones, far below the ~1,100 that importing the model runner to
check its hooks cost before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.needs_vllm]

MAX_NEW_MODULES = 25
# Modules only a worker needs: importing any of them from register() is the cost this file guards against.
HEAVY = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.core.sched.scheduler",
    "vllm.model_executor.models",
)
RUNNER_PATCHES = [
    "EchoDrafterPatch",
    "EchoVerificationFeedbackPatch",
    "EchoZeroDraftSamplePatch",
    "EchoTreeInputsPatch",
    "EchoTreeKVCompactionPatch",
    "EchoTreeCudagraphGuardPatch",
]
FRONT_PATCHES = ["SpeculativeConfigPathPatch", "EchoEngineConfigPatch"]


def _run(*parts: str, argv: list[str] | None = None) -> dict:
    """Run the code `parts` in a fresh interpreter after `import vllm`; they fill the dict `out` (printed as JSON)."""
    script = "import json, sys\nimport vllm\nout = {}\n" + "".join(textwrap.dedent(p) for p in parts)
    script += "\nprint('@@' + json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, *(argv or [])], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][2:])


_STATE = """
from echo_vllm.vllm import patches, post_import
def state():
    return {
        "applied": [p.__name__ for p in patches.PATCHES if p._applied],
        "pending": post_import.pending(),
    }
"""


def test_register_without_echo_imports_no_vllm_module():
    """In vLLM's own calling context (vllm.engine.arg_utils loaded): the front patches go in at once, the
    runner's wait for the runner's import, and register() itself loads only echo-vllm modules."""
    out = _run(
        """
        import vllm.engine.arg_utils
        before = set(sys.modules)
        from echo_vllm.vllm import plugin
        plugin.register()
        out["new"] = sorted(set(sys.modules) - before)
        """,
        _STATE,
        """
        out["after_register"] = state()
        import vllm.v1.worker.gpu_model_runner as runner
        out["after_runner_import"] = state()
        out["init_patch"] = getattr(runner.GPUModelRunner.__init__, "__echo_patch__", None)
        out["plugin_patches"] = plugin.applied_patches()
        """,
    )
    new = out["new"]
    assert not [m for m in new if m == "vllm" or m.startswith("vllm.")], new
    assert not [m for m in new for heavy in HEAVY if m.startswith(heavy)], new
    assert all(m.startswith("echo_vllm") for m in new), [m for m in new if not m.startswith("echo_vllm")]
    assert len(new) <= MAX_NEW_MODULES, (len(new), new)
    assert out["after_register"] == {"applied": FRONT_PATCHES, "pending": ["vllm.v1.worker.gpu_model_runner"]}
    # vLLM's import of the runner puts its patches in before anything can build a runner
    assert out["after_runner_import"] == {"applied": FRONT_PATCHES + RUNNER_PATCHES, "pending": []}
    assert out["init_patch"] == "EchoDrafterPatch"
    assert out["plugin_patches"] == FRONT_PATCHES + RUNNER_PATCHES


def test_register_before_arg_utils_waits_for_it():
    out = _run(
        """
        before = set(sys.modules)
        from echo_vllm.vllm import plugin
        plugin.register()
        out["new_vllm"] = sorted(m for m in set(sys.modules) - before if m.startswith("vllm"))
        """,
        _STATE,
        """
        out["after_register"] = state()
        import vllm.engine.arg_utils
        out["after_arg_utils"] = state()
        """,
    )
    assert out["new_vllm"] == []
    assert out["after_register"]["applied"] == []
    assert out["after_arg_utils"]["applied"] == FRONT_PATCHES


def test_echo_on_the_command_line_checks_everything_at_register(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    spec = json.dumps({"method": "echo", "model": str(head), "num_speculative_tokens": 2})
    out = _run(
        """
        import vllm.engine.arg_utils
        from echo_vllm.vllm import plugin
        plugin.register()
        out["runner_loaded"] = "vllm.v1.worker.gpu_model_runner" in sys.modules
        """,
        _STATE,
        """
        out["state"] = state()
        """,
        argv=["--speculative-config", spec],
    )
    assert out["runner_loaded"]  # the whole table was resolved: a drift anywhere stops this process at once
    assert out["state"] == {"applied": FRONT_PATCHES + RUNNER_PATCHES, "pending": []}


def test_drift_in_a_module_loaded_later_keeps_its_patches_out():
    """A drift the register()-time check could not see (its module was not loaded) is caught when the runner
    loads: the runner's patches stay out, and an ECHO request then fails with the one-line message."""
    out = _run(
        """
        import vllm.engine.arg_utils
        from echo_vllm.vllm import plugin
        plugin.register()
        from vllm.v1.spec_decode import llm_base_proposer

        def _sample_draft_tokens(self, hidden_states, sampling_metadata, temperature):
            raise AssertionError("never called")

        llm_base_proposer.SpecDecodeBaseProposer._sample_draft_tokens = _sample_draft_tokens
        out["runner_loaded_before"] = "vllm.v1.worker.gpu_model_runner" in sys.modules
        import vllm.v1.worker.gpu_model_runner
        """,
        _STATE,
        """
        out["state"] = state()
        from echo_vllm.config import EchoConfigError
        try:
            patches._require_all_hooks()
            out["echo_request"] = "accepted"
        except EchoConfigError as err:
            out["echo_request"] = str(err)
        """,
    )
    assert out["runner_loaded_before"] is False
    assert out["state"] == {"applied": FRONT_PATCHES, "pending": []}
    message = out["echo_request"]
    assert "changed signatures" in message and "_sample_draft_tokens" in message and "pip install" in message
    assert "\n" not in message
