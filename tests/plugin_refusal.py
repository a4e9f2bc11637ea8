"""Shared check for tests of the plugin's refusal path (version or hook drift): nothing is patched, and a
process that asked for ECHO stops with one line."""

from __future__ import annotations

import pytest


def register_refuses(monkeypatch: pytest.MonkeyPatch) -> str:
    """Call plugin.register() without and then with ECHO requested; return the one-line exit message."""
    from echo_vllm.vllm import hooks, patches, plugin

    hooks._check_cached.cache_clear()
    monkeypatch.setattr(plugin, "_state", {"registered": False, "patches": []})
    try:
        applied = [p for p in patches.PATCHES if p._applied]
        plugin.register()  # ECHO not requested: a warning, no patch
        assert [p for p in patches.PATCHES if p._applied] == applied
        monkeypatch.setattr(plugin, "_state", {"registered": False, "patches": []})
        monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", "--speculative-config", '{"method": "echo"}'])
        with pytest.raises(SystemExit) as stop:
            plugin.register()
    finally:
        hooks._check_cached.cache_clear()
    message = str(stop.value)
    assert "\n" not in message and "pip install" in message
    return message
