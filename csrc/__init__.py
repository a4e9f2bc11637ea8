"""Build helpers for the compiled ops (not installed; used by setup.py through csrc.build)."""
