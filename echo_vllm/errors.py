"""One base class for errors a user can fix: the CLI prints them as one line (no traceback) and exits 2."""

from __future__ import annotations


class EchoUserError(Exception):
    """Bad input, missing files, wrong versions: the message names the field and the fix."""
