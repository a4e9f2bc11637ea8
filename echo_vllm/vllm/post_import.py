"""Run a callback right after a module is imported: how the plugin patches a vLLM module only in the processes,
and at the moment, that load it (`when_imported`).

The API server never imports vLLM's model runner; a worker always does. Importing it just to patch it would cost
every process ~2 s and ~1,100 modules, so the runner's patches wait for vLLM's own import of the runner instead.
A `sys.meta_path` finder sees the import of a watched name, lets the other finders find it as usual and wraps
that one loader's `exec_module`: the callback runs when the module's body has run, before the importer gets the
module back, so nothing can use the unpatched module. A module that is already imported gets the callback at once.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.echo_vllm")

Callback = Callable[[ModuleType], None]


def is_loaded(name: str) -> bool:
    """Imported and done executing (a module in the middle of its own import is in sys.modules already)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _Watcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self.lock = threading.RLock()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        with self.lock:
            if fullname not in self.pending:
                return None
            callbacks = self.pending.pop(fullname)
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):  # not found / a namespace package: no body
            with self.lock:
                self.pending.setdefault(fullname, []).extend(callbacks)
            return None
        run_body = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_body(module)
            loader.__dict__.pop("exec_module", None)  # this loader instance is the module's; leave it as it was
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # an instance attribute on this module's own loader only
        return spec


_watcher = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` is imported in this process: now if it is, else right after its body."""
    if name in sys.modules:  # loaded (or, in no flow of vLLM's, half-way through its body: the check then fails)
        callback(sys.modules[name])
        return
    with _watcher.lock:
        _watcher.pending.setdefault(name, []).append(callback)
        if _watcher not in sys.meta_path:
            sys.meta_path.insert(0, _watcher)


def pending() -> list[str]:
    """The module names still watched (tests, diagnostics)."""
    with _watcher.lock:
        return sorted(_watcher.pending)
