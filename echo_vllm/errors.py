"""The errors a user can fix: the CLI prints them as one line `echo-vllm: error: ...` (no traceback), exit 2.

One base and one subclass per kind of thing the user fixes; modules subclass these (keeping a ValueError or
RuntimeError base where callers catch those) instead of inventing bases of their own. Anything else that
escapes the CLI, a FileNotFoundError from deep inside a library included, is a bug and keeps its traceback.
"""

from __future__ import annotations


class EchoUserError(Exception):
    """Bad input, missing files, wrong versions: the message names the field or file and the fix."""


class ConfigError(EchoUserError, ValueError):
    """echo.json / `--speculative-config`, the `echo` settings block, benchmark and soak options."""


class CalibrationError(EchoUserError, ValueError):
    """A calibration file (or calibration input) that cannot be used; the message names the file, field and fix."""


class InputError(EchoUserError, ValueError):
    """Inputs other than config: the testbed, model and head directories, prompt sets, prompts, output paths."""


class SetupError(EchoUserError, RuntimeError):
    """The installation or machine cannot do what was asked: a missing package or tool, too few CPUs, a server
    that does not come up. The message names what to install or change."""
