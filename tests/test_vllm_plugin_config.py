"""The echo-vllm plugin without an engine: config translation, argparse type, hook table, version gate."""

from __future__ import annotations

import argparse
import json

import pytest
from plugin_refusal import register_refuses

from echo_vllm.config import EchoConfigError
from echo_vllm.vllm import hooks, spec

pytestmark = [pytest.mark.needs_vllm]


@pytest.fixture()
def head(tmp_path):
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 8}))
    return str(d)


def _spec(head, **echo):
    return {"method": "echo", "model": head, "num_speculative_tokens": 4, "echo": echo}


def test_translate_to_eagle3(head):
    eagle, payload = spec.translate(_spec(head, k_max=6, warmup_steps=3))
    # The default top_k 4 drafts trees: vLLM's num_speculative_tokens is the tree capacity, ECHO's depth stays 4.
    assert eagle == {"method": "eagle3", "model": head, "num_speculative_tokens": 16}
    assert payload["max_depth"] == 4 and payload["settings"]["k_max"] == 6 and payload["settings"]["warmup_steps"] == 3
    assert payload["tree"] is True


def test_translate_chains_and_tree_capacity(head):
    eagle, payload = spec.translate(_spec(head, top_k=1))
    assert eagle["num_speculative_tokens"] == 4 and payload["tree"] is False
    eagle, payload = spec.translate(_spec(head, top_k=4), trees_supported=False)  # a platform without trees
    assert eagle["num_speculative_tokens"] == 4 and payload["tree"] is False
    too_big = _spec(head, top_k=16)
    too_big["num_speculative_tokens"] = 4
    with pytest.raises(EchoConfigError, match="tree capacity 63") as err:
        spec.translate(too_big)
    assert "\n" not in str(err.value) and "top_k" in str(err.value)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda s: s["echo"].update(bogus=1), "echo.bogus: unknown key"),
        (lambda s: s["echo"].update(k_max=-1), "k_max must be >= 0"),
        (lambda s: s.update(num_speculative_tokens=0), "num_speculative_tokens"),
        (lambda s: s.update(model="/nonexistent/head"), "EAGLE-3 head"),
    ],
    ids=["unknown-key", "negative-kmax", "depth-0", "missing-head"],
)
def test_bad_configs_are_one_line_errors(head, mutate, needle):
    s = _spec(head)
    mutate(s)
    with pytest.raises(EchoConfigError) as err:
        spec.translate(s)
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError):
        spec.speculative_config_arg(json.dumps(s))


def test_corrupt_calibration_file(head, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    with pytest.raises(EchoConfigError, match="calibration_file"):
        spec.translate(_spec(head, calibration_file=str(bad)))


def test_speculative_config_accepts_path_and_string(head, tmp_path):
    s = _spec(head, k_max=3)
    path = tmp_path / "echo.json"
    path.write_text(json.dumps(s))
    assert spec.speculative_config_arg(str(path)) == s
    assert spec.speculative_config_arg(json.dumps(s)) == s
    eagle = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    assert spec.speculative_config_arg(json.dumps(eagle)) == eagle  # non-ECHO configs pass through untouched


def test_hook_table_resolves_on_pinned_vllm():
    report = hooks.check_hooks(cached=False)
    assert report.version_ok, report
    assert report.missing == (), report.missing


def test_hook_table_lists_every_patch():
    from echo_vllm.vllm.patches import PATCHES

    patched = {h.name: h.patch for h in hooks.HOOKS if h.kind == "patch"}
    assert patched == {p.hook: p.__name__ for p in PATCHES}


def test_wrong_version_changes_nothing_and_stops_echo(monkeypatch):
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.31.2")
    message = register_refuses(monkeypatch)
    assert "0.31.2" in message and "0.32.0" in message and "EngineArgs.create_engine_config" in message


def _engine_parser(patched: bool):
    """vLLM's own argument parser, with or without SpeculativeConfigPathPatch (restored afterwards)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from echo_vllm.vllm.patches import SpeculativeConfigPathPatch as patch

    was_applied = patch._applied
    patch.apply() if patched else patch.revert()
    try:
        return EngineArgs.add_cli_args(FlexibleArgumentParser())
    finally:
        patch.apply() if was_applied else patch.revert()


@pytest.mark.parametrize(
    "value",
    ["None", "", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
    ids=["None", "empty", "json"],
)
def test_every_spelling_vllm_accepts_parses_the_same_with_the_plugin(value):
    """`--speculative-config None` / "" (a YAML `speculative-config: null` becomes "None") mean no speculation to
    vLLM; with the plugin they must too, and a JSON string must parse to the same object."""
    argv = ["--speculative-config", value]
    plain = _engine_parser(patched=False).parse_args(argv).speculative_config
    assert _engine_parser(patched=True).parse_args(argv).speculative_config == plain
    assert plain is None or isinstance(plain, dict)


def test_the_plugin_adds_only_the_file_path(head, tmp_path, capsys):
    path = tmp_path / "echo.json"
    path.write_text(json.dumps(_spec(head, k_max=3)))
    assert _engine_parser(patched=True).parse_args(["-sc", str(path)]).speculative_config == _spec(head, k_max=3)
    with pytest.raises(SystemExit):
        _engine_parser(patched=False).parse_args(["-sc", str(path)])  # vLLM alone: json.loads of a path
    for parser in (_engine_parser(patched=True), _engine_parser(patched=False)):
        with pytest.raises(SystemExit):
            parser.parse_args(["-sc", str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_spec(head, k_max=-1)))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _engine_parser(patched=True).parse_args(["-sc", str(bad)])
    assert "k_max" in capsys.readouterr().err
