"""Where tests find the testbed: the prebuilt one shipped in tests/assets (ECHO_TEST_TESTBED overrides)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHIPPED = Path(__file__).parent / "assets" / "testbed"


def shipped_testbed() -> Path:
    root = Path(os.environ.get("ECHO_TEST_TESTBED", SHIPPED))
    if not (root / "target" / "config.json").is_file():
        pytest.fail(
            f"testbed missing at {root}: it is committed under tests/assets/testbed "
            "(rebuild: echo-vllm testbed build --out tests/assets/testbed)"
        )
    return root
