"""``python -m capture_arena.sglang install | uninstall | check``: put capture-arena behind
SpecForge's SGLang hook module.

SpecForge's SGLang patch (``patches/sglang/<version>/spec-capture.patch``) adds
``python/sglang/srt/spec_capture_sink.py`` and makes the scheduler import it
(``from sglang.srt import spec_capture_sink``, ``from sglang.srt.spec_capture_sink import
gpu_put_enabled``). ``install`` keeps that file byte for byte as
``spec_capture_sink.py.capture-arena-orig`` and writes in its place a shim that makes
``sglang.srt.spec_capture_sink`` *be* :mod:`capture_arena.sglang` (``sys.modules`` points the
name at it, so there is one module and one ``_SINK``). ``uninstall`` puts the original back;
``check`` says which of the two is there.

``install`` and ``check`` also read the patched scheduler and its result processor to tell which
of SpecForge's published patches the installation has (:func:`detect`: what they import from the
hook module and call on it and on its sink), say which one they found, and refuse one that calls
a name :mod:`capture_arena.sglang` does not implement, naming it.

The sglang package directory (the one holding ``srt/``) is ``--sglang-dir`` or, by default, the
one this Python would import, found without importing sglang.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ._capture_arena import __version__
from ._patches import Variant, detect
from ._sink import ArenaSink
from ._store import StoreSink

__all__ = ["main", "shim_text", "find_sglang_dir", "SHIM_MARKER", "detect", "unsupported", "Variant"]

PROG = "python -m capture_arena.sglang"
MODULE = "spec_capture_sink"
BACKUP_SUFFIX = ".capture-arena-orig"
#: The shim's first line starts with this; the rest of the line is ``version=<capture-arena>``.
SHIM_MARKER = "# capture-arena-shim for sglang.srt.spec_capture_sink"
_MARKER_RE = re.compile(r"^# capture-arena-shim for sglang\.srt\.spec_capture_sink version=(\S+)\s*$")
#: The names the published SpecForge patches import from the hook module.
REQUIRED_NAMES = ("maybe_init_sink", "get_sink", "gpu_put_enabled", "maybe_live_spec")
_HOOK_DEFS = (re.compile(rb"^def maybe_init_sink\b", re.M), re.compile(rb"^def get_sink\b", re.M))

_PATCH_HOW = (
    "scripts/apply_sglang_spec_capture_patch.sh in SpecForge, or "
    "`git apply patches/sglang/<version>/spec-capture.patch` in the sglang checkout "
    "(it adds python/sglang/srt/spec_capture_sink.py)"
)
_APPLY_PATCH = f"apply SpecForge's SGLang patch first: {_PATCH_HOW}"

# Indirection so tests can pretend sglang is not installed.
_find_spec = importlib.util.find_spec


class _Fail(Exception):
    """A refusal or error: one line, exit status 2."""


def shim_text(version: str = __version__) -> str:
    """The whole content of the shim ``spec_capture_sink.py`` install writes."""
    return f"""{SHIM_MARKER} version={version}
# Written by `{PROG} install`: sglang.srt.spec_capture_sink *is* capture_arena.sglang.
# SpecForge's original module is kept byte for byte next to this file as
# spec_capture_sink.py{BACKUP_SUFFIX}; `{PROG} uninstall` puts it back.
import sys

try:
    import capture_arena.sglang as _capture_arena_sglang
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "sglang.srt.spec_capture_sink is capture-arena's shim, but capture_arena.sglang cannot be "
        f"imported in this Python ({{e}}); install capture-arena here, or restore SpecForge's "
        "module from spec_capture_sink.py{BACKUP_SUFFIX} next to this file"
    ) from e

sys.modules[__name__] = _capture_arena_sglang
"""


def _shim_version(data: bytes) -> Optional[str]:
    """The capture-arena version named by a shim's marker line, or None if ``data`` is no shim."""
    first = data.split(b"\n", 1)[0].decode("utf-8", "replace")
    m = _MARKER_RE.match(first)
    return m.group(1) if m else None


def _looks_like_hook_module(data: bytes) -> bool:
    return all(p.search(data) for p in _HOOK_DEFS)


def find_sglang_dir() -> Path:
    """The ``sglang`` package directory this Python would import, found without importing it."""
    try:
        spec = _find_spec("sglang")
    except (ImportError, ValueError) as e:
        raise _Fail(f"cannot locate the sglang package ({e}); pass --sglang-dir DIR") from None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise _Fail(
            f"sglang is not importable by this Python ({sys.executable}); "
            "pass --sglang-dir DIR (the sglang package directory, the one holding srt/)"
        )
    for loc in locations:
        if (Path(loc) / "srt").is_dir():
            return Path(loc)
    raise _Fail(f"the sglang package found at {locations[0]} has no srt/ directory; pass --sglang-dir DIR")


def _srt_dir(sglang_dir: Optional[str]) -> Path:
    d = Path(sglang_dir) if sglang_dir is not None else find_sglang_dir()
    srt = d / "srt"
    if srt.is_dir():
        return srt
    if not d.is_dir():
        raise _Fail(f"--sglang-dir {d}: no such directory")
    hints = [c for c in (d / "sglang", d / "python" / "sglang") if (c / "srt").is_dir()]
    hint = f" (did you mean --sglang-dir {hints[0]}?)" if hints else ""
    raise _Fail(f"{d} is not the sglang package directory: it has no srt/ subdirectory{hint}")


def _read(p: Path) -> Optional[bytes]:
    try:
        return p.read_bytes()
    except FileNotFoundError:
        return None


def _write_tmp(directory: Path, data: bytes, mode: int) -> Path:
    fd, name = tempfile.mkstemp(dir=directory, prefix=f".{MODULE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(name, mode)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = _write_tmp(path.parent, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Writes ``path`` atomically, never replacing an existing file."""
    tmp = _write_tmp(path.parent, data, mode)
    try:
        try:
            os.link(tmp, path)  # fails if path exists
        except FileExistsError:
            raise _Fail(f"{path} already exists; not overwriting it") from None
        except OSError:  # no hard links on this filesystem
            if path.exists():
                raise _Fail(f"{path} already exists; not overwriting it") from None
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            os.unlink(tmp)


def _drop_bytecode(srt: Path) -> int:
    """Removes the module's stale bytecode (it would shadow the new file's), saying so; 0."""
    for pyc in sorted(glob.glob(str(srt / "__pycache__" / f"{MODULE}.*.pyc"))):
        os.unlink(pyc)
        print(f"removed stale {pyc}")
    return 0


def _mode(p: Path) -> int:
    try:
        return p.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o644


def unsupported(variant: Variant) -> list[str]:
    """The names ``variant`` calls that capture_arena.sglang (or its sinks) lack."""
    return variant.missing(importlib.import_module("capture_arena.sglang"), (ArenaSink, StoreSink))


def _variant(srt: Path, say: bool = True) -> Variant:
    """The patch at ``srt``, said; a refusal if it is not applied or asks for a name
    capture_arena.sglang does not implement."""
    variant = detect(srt)
    if variant is None:
        raise _Fail(
            f"nothing in {srt / 'managers'} imports sglang.srt.{MODULE}: SpecForge's SGLang patch is not applied "
            f"to the scheduler; {_APPLY_PATCH}"
        )
    missing = unsupported(variant)
    if missing:
        raise _Fail(
            f"found {variant.describe()}, but capture-arena {__version__} does not implement {', '.join(missing)}: "
            "this variant of the patch is not supported; keep SpecForge's module, or upgrade capture-arena"
        )
    if variant.name == "unrecognised":
        # No sink call was found where the patches make them: whatever the scheduler calls on
        # the sink would be unchecked (an AttributeError in its loop), and whether it calls
        # synchronously unknown.
        raise _Fail(
            f"found {variant.describe()}: capture-arena {__version__} does not recognise this patch (no call on "
            f"the sink in {', '.join(variant.files)}); keep SpecForge's module, or upgrade capture-arena"
        )
    if say:
        print(f"found {variant.describe()}")
    return variant


def install(sglang_dir: Optional[str]) -> int:
    srt = _srt_dir(sglang_dir)
    target, backup = srt / f"{MODULE}.py", srt / f"{MODULE}.py{BACKUP_SUFFIX}"
    current, saved = _read(target), _read(backup)
    shim = shim_text().encode()
    if current is None and saved is None:
        raise _Fail(f"{target} does not exist: SpecForge's SGLang patch is not applied; {_APPLY_PATCH}")
    if current is not None and _shim_version(current) is None and not _looks_like_hook_module(current):
        raise _Fail(
            f"{target} does not look like SpecForge's hook module (no `def maybe_init_sink` and "
            f"`def get_sink`); not replacing it; {_APPLY_PATCH}"
        )
    _variant(srt)
    if current == shim:
        print(f"already installed: {target} is capture-arena {__version__}'s shim")
        if saved is None:
            print(f"note: no backup of SpecForge's module at {backup}; uninstall will not be able to restore it")
        # An install that failed after writing the shim (removing the bytecode) is finished here.
        return _drop_bytecode(srt)
    if current is not None and _shim_version(current) is not None:
        _write_atomic(target, shim, _mode(target))
        print(f"updated {target}: capture-arena {_shim_version(current)}'s shim -> {__version__}'s")
    else:
        if current is None:
            if saved is None:
                raise _Fail(f"{target} does not exist: SpecForge's SGLang patch is not applied; {_APPLY_PATCH}")
            print(f"{target} is missing; SpecForge's module is kept at {backup}")
        elif not _looks_like_hook_module(current):
            raise _Fail(
                f"{target} does not look like SpecForge's hook module (no `def maybe_init_sink` and "
                f"`def get_sink`); not replacing it; {_APPLY_PATCH}"
            )
        elif saved is not None and saved != current:
            raise _Fail(
                f"{backup} already exists and differs from {target}; not overwriting it. If {target} "
                f"is the module to keep, move {backup} away and run install again"
            )
        elif saved is None:
            _create_exclusive(backup, current, _mode(target))
            print(f"kept SpecForge's module byte for byte as {backup}")
        else:
            print(f"SpecForge's module is already kept at {backup}")
        _write_atomic(target, shim, _mode(target))
        print(f"wrote {target}: sglang.srt.{MODULE} is now capture_arena.sglang (capture-arena {__version__})")
    return _drop_bytecode(srt)


def uninstall(sglang_dir: Optional[str]) -> int:
    srt = _srt_dir(sglang_dir)
    target, backup = srt / f"{MODULE}.py", srt / f"{MODULE}.py{BACKUP_SUFFIX}"
    current, saved = _read(target), _read(backup)
    is_shim = current is not None and _shim_version(current) is not None
    if saved is None:
        if is_shim:
            raise _Fail(
                f"{target} is capture-arena's shim but there is no backup {backup} to restore; "
                f"to get SpecForge's module back, delete {target} and re-apply SpecForge's SGLang patch: {_PATCH_HOW}"
            )
        print(f"nothing to uninstall: {target} is not capture-arena's shim and there is no backup")
        return 0
    if current is not None and not is_shim:
        if current == saved:
            os.unlink(backup)
            print(f"nothing to uninstall: {target} is SpecForge's module; removed the identical backup {backup}")
            return 0
        raise _Fail(
            f"{target} is not capture-arena's shim (it was changed since install) and {backup} exists; "
            f"to keep the current file delete {backup}, to restore the original move {backup} to {target}"
        )
    os.replace(backup, target)
    print(f"restored SpecForge's module to {target} (byte for byte) and removed {backup}")
    return _drop_bytecode(srt)


def check(sglang_dir: Optional[str]) -> int:
    srt = _srt_dir(sglang_dir)
    target, backup = srt / f"{MODULE}.py", srt / f"{MODULE}.py{BACKUP_SUFFIX}"
    current = _read(target)
    if current is None:
        extra = f" ({backup} exists: run `{PROG} install` to put the shim back)" if backup.exists() else ""
        print(f"not installed: {target} does not exist: SpecForge's SGLang patch is not applied{extra}")
        return 1
    version = _shim_version(current)
    if version is None:
        if _looks_like_hook_module(current):
            print(f"not installed: {target} is SpecForge's original hook module; run `{PROG} install`")
        else:
            print(f"not installed: {target} is neither SpecForge's hook module nor capture-arena's shim")
        return 1
    if version != __version__ or current != shim_text(version).encode():
        what = f"capture-arena {version}'s shim" if version != __version__ else "a modified capture-arena shim"
        print(f"not installed: {target} is {what}, this is capture-arena {__version__}; run `{PROG} install`")
        return 1
    try:
        mod = importlib.import_module("capture_arena.sglang")
    except Exception as e:
        print(f"broken: {target} is the shim but capture_arena.sglang does not import: {type(e).__name__}: {e}")
        return 1
    missing = [n for n in REQUIRED_NAMES if not callable(getattr(mod, n, None))]
    if missing:
        print(f"broken: {target} is the shim but capture_arena.sglang lacks {', '.join(missing)}")
        return 1
    try:
        variant = _variant(srt, say=False)
    except _Fail as e:
        print(f"broken: {target} is the shim, but {e}")
        return 1
    print(f"installed: {target} is capture-arena {__version__}'s shim (sglang.srt.{MODULE} -> capture_arena.sglang)")
    print(f"found {variant.describe()}")
    if not backup.exists():
        print(f"note: no backup of SpecForge's module at {backup}; uninstall will not be able to restore it")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Put capture-arena behind SpecForge's SGLang hook module.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{install,uninstall,check}")
    for name, help in (
        ("install", "replace sglang/srt/spec_capture_sink.py with a shim for capture_arena.sglang"),
        ("uninstall", "restore SpecForge's spec_capture_sink.py"),
        ("check", "exit 0 if the shim is installed, 1 if not"),
    ):
        sp = sub.add_parser(name, help=help)
        sp.add_argument(
            "--sglang-dir", metavar="DIR", help="the sglang package directory (holding srt/); default: the importable one"
        )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    run = {"install": install, "uninstall": uninstall, "check": check}[args.command]
    try:
        return run(args.sglang_dir)
    except _Fail as e:
        return _error(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        return _error(f"{args.command} failed: {e.strerror or e}{where}")


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
