"""One attention backend of vLLM's registry pointed at a tree-capable subclass, reversibly (tree_attn_cpu/_cuda).

vLLM resolves a backend's class path lazily, when layers pick their backend, and memoises the result; so the
override clears the selector cache, and it remembers any override someone else set first, to put it back.
"""

from __future__ import annotations

from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend


class BackendOverride:
    def __init__(self, member: AttentionBackendEnum, class_path: str) -> None:
        self.member = member
        self.class_path = class_path
        self._previous: str | None = None  # the override before ours (None: vLLM's own class)

    def active(self) -> bool:
        return self.member.is_overridden() and self.member.get_path() == self.class_path

    def register(self) -> str:
        """Idempotent; returns the class path."""
        if not self.active():
            self._previous = self.member.get_path() if self.member.is_overridden() else None
            register_backend(self.member, self.class_path)
        _clear_selector_cache()
        return self.class_path

    def unregister(self) -> None:
        """The member resolves to what it did before; a no-op when ours is not registered."""
        if not self.active():
            return
        previous, self._previous = self._previous, None
        if previous is not None:
            register_backend(self.member, previous)
        else:
            self.member.clear_override()
        _clear_selector_cache()


def _clear_selector_cache() -> None:
    # get_attn_backend memoises the resolved class; without this, layers built later keep the stock backend.
    from vllm.v1.attention.selector import _cached_get_attn_backend

    _cached_get_attn_backend.cache_clear()
