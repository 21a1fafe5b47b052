"""``python -m capture_arena.sglang install | uninstall | check`` against the REAL sglang wheel.

The wheel (``sglang==0.5.20`` from PyPI) is downloaded without dependencies and unpacked; the
hook module SpecForge's SGLang patch adds (``sglang/srt/spec_capture_sink.py``) is not in the
wheel, so the tests write a stand-in with the same shape (``STANDIN``: written for these tests,
not SpecForge's code) where the patch puts it.

Importing ``sglang.srt.spec_capture_sink`` the plain way runs ``sglang/__init__.py``, which needs
sglang's dependencies (numpy, torch, transformers, ...; see
``test_plain_import_of_real_sglang_wheel_needs_sglang_dependencies``). The import tests therefore
create the ``sglang`` package object from its real spec without executing its ``__init__.py``
and let the ordinary import machinery find ``sglang.srt`` (a namespace package in the wheel) and
the shim; and, separately, load the shim by path with importlib.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import sglang_patches

SGLANG_VERSION = "0.5.20"
CLI = "capture_arena._install"  # what `python -m capture_arena.sglang` runs
BACKUP = "spec_capture_sink.py.capture-arena-orig"
#: Every name the published patches (v0.5.18, v0.5.20) import from the hook module, and the
#: sink class SpecForge's tests use.
PATCH_NAMES = ("maybe_init_sink", "get_sink", "gpu_put_enabled", "SpecCaptureSink")

# A stand-in for the hook module SpecForge's patch adds: the same public shape (a sink class,
# maybe_init_sink(server_args), get_sink(), gpu_put_enabled(), module-level _SINK). A non-ASCII
# comment, CRLF line endings and no final newline make "byte for byte" mean something.
STANDIN = (
    textwrap.dedent(
        '''\
        """Stand-in for SpecForge's sglang/srt/spec_capture_sink.py (capture-arena's tests)."""
        # Hidden states → a capture store; “quotes” and ü keep this file non-ASCII.
        from __future__ import annotations

        import logging
        import os
        from typing import Any, Optional

        logger = logging.getLogger(__name__)


        class SpecCaptureSink:
            def __init__(self, aux_layer_ids: Optional[list[int]] = None) -> None:
                self.aux_layer_ids = aux_layer_ids
                self.results: list[dict[str, Any]] = []

            def capture(self, spec: dict[str, Any], aux: Any, last_hidden: Any) -> dict[str, Any]:
                result = {"sample_id": spec.get("sample_id"), "ok": True}
                self.results.append(result)
                return result


        _SINK: Optional[SpecCaptureSink] = None


        def gpu_put_enabled() -> bool:
            return os.environ.get("STANDIN_GPU_PUT", "0") == "1"


        def maybe_init_sink(server_args: Any) -> Optional[SpecCaptureSink]:
            global _SINK
            if not getattr(server_args, "enable_spec_capture", False):
                return None
            if _SINK is None:
                _SINK = SpecCaptureSink(getattr(server_args, "spec_capture_aux_layer_ids", None))
                logger.info("stand-in sink created")
            return _SINK


        def get_sink() -> Optional[SpecCaptureSink]:
            return _SINK'''
    )
    .replace("\n", "\r\n")
    .encode("utf-8")
)


@pytest.fixture(scope="session")
def pristine_wheel_tree(sglang_tree: Callable[[str], Path]) -> Path:
    return sglang_tree(SGLANG_VERSION)


@pytest.fixture
def unpacked(pristine_wheel_tree: Path, tmp_path: Path) -> Path:
    """A private copy of the unpacked wheel (the directory that goes on PYTHONPATH)."""
    root = tmp_path / "site"
    shutil.copytree(pristine_wheel_tree, root, symlinks=True)
    return root


@pytest.fixture
def sglang_dir(unpacked: Path) -> Path:
    return unpacked / "sglang"


@pytest.fixture
def with_standin(sglang_dir: Path) -> Iterator[Path]:
    """The stand-in hook module where SpecForge's patch puts it (mode 0o640, to see it kept), and
    the v0.5.20 patch's calls in the scheduler and its result processor."""
    sglang_patches.apply(sglang_dir, "v0.5.20")
    target = sglang_dir / "srt" / "spec_capture_sink.py"
    target.write_bytes(STANDIN)
    target.chmod(0o640)
    yield target


def _env(pythonpath: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return env


def cli(*args: str, cwd: Path, pythonpath: Path | None = None, module: str = CLI) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(pythonpath),
        timeout=120,
    )


def _out(p: subprocess.CompletedProcess[str]) -> str:
    return p.stdout + p.stderr


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in _out(p), _out(p)


# The import as the scheduler does it, with the real import machinery: the `sglang` package
# object is made from its real spec but its __init__.py (torch, transformers, ...) is not run.
IMPORT_AS_THE_PATCH_DOES = """
import importlib, importlib.util, sys
spec = importlib.util.find_spec("sglang")
assert spec is not None and spec.origin.startswith(sys.argv[1]), spec
sys.modules["sglang"] = importlib.util.module_from_spec(spec)  # not executed
# The import system finds the shim in the unpacked wheel (sglang.srt: a namespace package).
assert importlib.util.find_spec("sglang.srt.spec_capture_sink").origin == sys.argv[2]

from sglang.srt import spec_capture_sink  # scheduler.py: maybe_init_sink / get_sink
from sglang.srt.spec_capture_sink import gpu_put_enabled  # scheduler.py (v0.5.20)
from sglang.srt.spec_capture_sink import SpecCaptureSink, get_sink, maybe_init_sink
import capture_arena.sglang as ca_sglang

assert spec_capture_sink is ca_sglang, spec_capture_sink
assert sys.modules["sglang.srt.spec_capture_sink"] is ca_sglang
assert importlib.import_module("sglang.srt.spec_capture_sink") is ca_sglang
assert gpu_put_enabled is ca_sglang.gpu_put_enabled and maybe_init_sink is ca_sglang.maybe_init_sink
assert get_sink is ca_sglang.get_sink and SpecCaptureSink is ca_sglang.SpecCaptureSink
assert "sglang.lang" not in sys.modules, "sglang/__init__.py was not run"
# One module, so one _SINK: what capture_arena.sglang holds is what the scheduler sees.
ca_sglang._SINK = marker = object()
assert spec_capture_sink.get_sink() is marker
ca_sglang._SINK = None
print("resolved", ca_sglang.__name__)
"""

# The shim loaded by path under its sglang name (no sglang package involved at all).
LOAD_BY_PATH = """
import importlib.util, sys
name = "sglang.srt.spec_capture_sink"
spec = importlib.util.spec_from_file_location(name, sys.argv[1])
shim = importlib.util.module_from_spec(spec)
sys.modules[name] = shim
spec.loader.exec_module(shim)
import capture_arena.sglang
module = sys.modules[name]
assert module is capture_arena.sglang, module
for n in sys.argv[2:]:
    assert callable(getattr(module, n)), n
print("resolved", module.__name__)
"""


def test_install_refuses_without_hook_module_in_real_sglang_wheel(sglang_dir: Path, tmp_path: Path) -> None:
    before = _snapshot(sglang_dir / "srt")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 2, _out(p)
    assert "spec_capture_sink.py does not exist" in p.stderr
    assert "scripts/apply_sglang_spec_capture_patch.sh" in p.stderr
    assert "git apply patches/sglang/<version>/spec-capture.patch" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    _no_traceback(p)
    assert _snapshot(sglang_dir / "srt") == before, "nothing was written"
    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 1 and "patch is not applied" in c.stdout, _out(c)


def test_install_refuses_a_file_that_is_not_specforges_hook_module(sglang_dir: Path, tmp_path: Path) -> None:
    target = sglang_dir / "srt" / "spec_capture_sink.py"
    target.write_bytes(b"# someone else's module\nX = 1\n")
    before = _snapshot(sglang_dir / "srt")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 2 and "does not look like SpecForge's hook module" in p.stderr, _out(p)
    assert "apply_sglang_spec_capture_patch.sh" in p.stderr
    _no_traceback(p)
    assert _snapshot(sglang_dir / "srt") == before
    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 1 and "neither SpecForge's hook module nor capture-arena's shim" in c.stdout, _out(c)


def test_install_into_real_sglang_wheel_with_standin_hook_module(
    unpacked: Path, sglang_dir: Path, with_standin: Path, tmp_path: Path
) -> None:
    srt = sglang_dir / "srt"
    target, backup = with_standin, srt / BACKUP
    pycache = srt / "__pycache__"
    pycache.mkdir(exist_ok=True)
    stale = pycache / f"spec_capture_sink.{sys.implementation.cache_tag}.pyc"
    stale.write_bytes(b"stale bytecode of the original module")
    other = pycache / f"environ.{sys.implementation.cache_tag}.pyc"
    other.write_bytes(b"another module's bytecode")

    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 1 and "SpecForge's original hook module" in c.stdout, _out(c)

    # install: the shim in place, the stand-in kept byte for byte (and its mode), stale bytecode gone
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 0, _out(p)
    _no_traceback(p)
    assert str(backup) in p.stdout and "wrote" in p.stdout and "removed stale" in p.stdout, p.stdout
    assert backup.read_bytes() == STANDIN
    assert stat.S_IMODE(backup.stat().st_mode) == 0o640
    shim = target.read_bytes()
    assert shim != STANDIN and shim.startswith(b"# capture-arena-shim for sglang.srt.spec_capture_sink version=")
    assert b"sys.modules[__name__] = " in shim and b"import capture_arena.sglang" in shim
    assert not stale.exists() and other.exists()
    assert not list(srt.glob(".spec_capture_sink.*.tmp")), "no temporary files left"

    # install again: nothing changes
    after_first = _snapshot(srt)
    p2 = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p2.returncode == 0 and "already installed" in p2.stdout, _out(p2)
    assert _snapshot(srt) == after_first

    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 0 and c.stdout.startswith("installed:"), _out(c)

    # sglang.srt.spec_capture_sink is capture_arena.sglang, with every name the patches import
    script = tmp_path / "import_as_the_patch_does.py"
    script.write_text(IMPORT_AS_THE_PATCH_DOES)
    r = subprocess.run(
        [sys.executable, str(script), str(unpacked), str(target)],
        capture_output=True, text=True, cwd=tmp_path, env=_env(unpacked), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "resolved capture_arena.sglang" in r.stdout, _out(r)
    script = tmp_path / "load_by_path.py"
    script.write_text(LOAD_BY_PATH)
    r = subprocess.run(
        [sys.executable, str(script), str(target), *PATCH_NAMES],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "resolved capture_arena.sglang" in r.stdout, _out(r)

    # uninstall: the stand-in back byte for byte, with its mode; no backup left
    u = cli("uninstall", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert u.returncode == 0 and "restored" in u.stdout, _out(u)
    assert target.read_bytes() == STANDIN
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert not backup.exists()
    assert sorted(p.name for p in srt.glob("spec_capture_sink*")) == ["spec_capture_sink.py"]

    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 1 and "SpecForge's original hook module" in c.stdout, _out(c)

    u2 = cli("uninstall", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert u2.returncode == 0 and "nothing to uninstall" in u2.stdout, _out(u2)
    assert target.read_bytes() == STANDIN


def test_capture_arena_sglang_defines_every_name_the_patches_import() -> None:
    import capture_arena.sglang as m

    missing = [n for n in PATCH_NAMES if not callable(getattr(m, n, None))]
    assert not missing, f"capture_arena.sglang lacks {missing}"


def test_default_sglang_dir_is_the_importable_real_sglang_wheel_with_standin_hook_module(
    unpacked: Path, sglang_dir: Path, with_standin: Path, tmp_path: Path
) -> None:
    # No --sglang-dir: the sglang this Python imports (found without importing it).
    p = cli("install", cwd=tmp_path, pythonpath=unpacked)
    assert p.returncode == 0, _out(p)
    assert (sglang_dir / "srt" / BACKUP).read_bytes() == STANDIN
    c = cli("check", cwd=tmp_path, pythonpath=unpacked)
    assert c.returncode == 0 and str(with_standin) in c.stdout, _out(c)
    u = cli("uninstall", cwd=tmp_path, pythonpath=unpacked)
    assert u.returncode == 0 and with_standin.read_bytes() == STANDIN, _out(u)


def test_no_importable_sglang_names_sglang_dir(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from capture_arena import _install

    monkeypatch.setattr(_install, "_find_spec", lambda name: None)
    for command in ("install", "uninstall", "check"):
        assert _install.main([command]) == 2
        err = capsys.readouterr().err
        assert "--sglang-dir" in err and "sglang is not importable" in err, err


def test_sglang_dir_without_srt_exits_2(tmp_path: Path) -> None:
    for command in ("install", "uninstall", "check"):
        p = cli(command, "--sglang-dir", str(tmp_path), cwd=tmp_path)
        assert p.returncode == 2 and "has no srt/" in p.stderr, _out(p)
        _no_traceback(p)
    p = cli("check", "--sglang-dir", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert p.returncode == 2 and "no such directory" in p.stderr, _out(p)


def test_sglang_dir_one_level_too_high_says_which_dir_in_real_sglang_wheel(unpacked: Path, tmp_path: Path) -> None:
    p = cli("check", "--sglang-dir", str(unpacked), cwd=tmp_path)
    assert p.returncode == 2 and f"did you mean --sglang-dir {unpacked / 'sglang'}" in p.stderr, _out(p)


def test_uninstall_refuses_when_the_shim_was_replaced_in_real_sglang_wheel_with_standin_hook_module(
    sglang_dir: Path, with_standin: Path, tmp_path: Path
) -> None:
    assert cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path).returncode == 0
    edited = STANDIN + b"\r\n# re-applied and edited\r\n"
    with_standin.write_bytes(edited)  # e.g. the patch applied again, then changed
    before = _snapshot(sglang_dir / "srt")
    u = cli("uninstall", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert u.returncode == 2 and "is not capture-arena's shim" in u.stderr, _out(u)
    assert f"delete {sglang_dir / 'srt' / BACKUP}" in u.stderr, u.stderr
    _no_traceback(u)
    assert _snapshot(sglang_dir / "srt") == before
    # install will not overwrite the backup with a different module either
    i = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert i.returncode == 2 and "already exists and differs" in i.stderr, _out(i)
    assert _snapshot(sglang_dir / "srt") == before


def test_shim_of_another_version_in_real_sglang_wheel_with_standin_hook_module(
    sglang_dir: Path, with_standin: Path, tmp_path: Path
) -> None:
    from capture_arena import _install

    assert cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path).returncode == 0
    with_standin.write_text(_install.shim_text("0.0.1"))
    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 1 and "capture-arena 0.0.1's shim" in c.stdout, _out(c)
    i = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert i.returncode == 0 and "updated" in i.stdout, _out(i)
    assert with_standin.read_text() == _install.shim_text()
    assert (sglang_dir / "srt" / BACKUP).read_bytes() == STANDIN
    u = cli("uninstall", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert u.returncode == 0 and with_standin.read_bytes() == STANDIN, _out(u)


def test_io_errors_are_one_line_in_real_sglang_wheel(sglang_dir: Path, tmp_path: Path) -> None:
    # A directory where the module should be: an OSError whoever runs the tests (root included).
    (sglang_dir / "srt" / "spec_capture_sink.py").mkdir()
    for command in ("install", "uninstall", "check"):
        p = cli(command, "--sglang-dir", str(sglang_dir), cwd=tmp_path)
        assert p.returncode == 2, _out(p)
        assert len(p.stderr.strip().splitlines()) == 1 and "spec_capture_sink.py" in p.stderr, p.stderr
        _no_traceback(p)


def test_plain_import_of_real_sglang_wheel_needs_sglang_dependencies(
    unpacked: Path, with_standin: Path, tmp_path: Path
) -> None:
    """What `import sglang.srt.spec_capture_sink` does from the bare wheel: sglang/__init__.py
    runs first and needs sglang's dependencies; where they are all installed the import works
    and resolves to capture_arena.sglang."""
    assert cli("install", "--sglang-dir", str(unpacked / "sglang"), cwd=tmp_path).returncode == 0
    code = textwrap.dedent(
        """
        import sys, traceback
        try:
            import sglang.srt.spec_capture_sink
        except Exception as e:  # ImportError where a dependency is missing
            frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
            assert not any(f.endswith("spec_capture_sink.py") for f in frames), frames
            assert frames and any(f.endswith("sglang/__init__.py") for f in frames), frames
            print("needs", getattr(e, "name", None) or type(e).__name__)
        else:
            import capture_arena.sglang
            assert sys.modules["sglang.srt.spec_capture_sink"] is capture_arena.sglang
            print("imports")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=_env(unpacked), timeout=300
    )
    assert r.returncode == 0, _out(r)
    assert r.stdout.startswith(("needs ", "imports")), r.stdout
    if r.stdout.startswith("needs "):
        missing = r.stdout.split()[1]
        assert missing.split(".")[0] not in ("sglang", "capture_arena"), r.stdout


def test_documented_entry_point_python_m_capture_arena_sglang(sglang_dir: Path, with_standin: Path, tmp_path: Path) -> None:
    p = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path, module="capture_arena.sglang")
    assert p.returncode == 1 and "SpecForge's original hook module" in p.stdout, _out(p)
    h = cli("--help", cwd=tmp_path, module="capture_arena.sglang")
    assert h.returncode == 0 and "python -m capture_arena.sglang" in h.stdout and "uninstall" in h.stdout, _out(h)


@pytest.mark.parametrize(
    "variant,version",
    # Every patch on 0.5.20's files; the newest wheel (0.5.23) with the newest patches.
    [(v, "0.5.20") for v in sorted(sglang_patches.FOUND)] + [("main-923e4a56", "0.5.23"), ("online-live", "0.5.23")],
)
def test_install_says_which_published_patch_it_found_and_keeps_the_module_in_real_sglang_wheel(
    sglang_tree: Callable[[str], Path], tmp_path: Path, variant: str, version: str
) -> None:
    """Each published patch, its calls added to a copy of the real wheel's scheduler and result
    processor: install names the patch, keeps SpecForge's module byte for byte, and the shim
    serves every name the patch calls; check names it too; uninstall restores the module."""
    root = sglang_patches.copy_tree(sglang_tree(version), tmp_path / "site")
    sglang_dir = root / "sglang"
    sglang_patches.apply(sglang_dir, variant)
    module = sglang_dir / "srt" / "spec_capture_sink.py"
    module.write_bytes(STANDIN)
    found = f"found SpecForge's {sglang_patches.FOUND[variant]} patch"
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 0 and found in p.stdout, _out(p)
    _no_traceback(p)
    assert (sglang_dir / "srt" / BACKUP).read_bytes() == STANDIN
    c = cli("check", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert c.returncode == 0 and found in c.stdout and "installed:" in c.stdout, _out(c)
    # Every name the patch calls resolves through the shim (the module and its sinks).
    from capture_arena import _install

    v = _install.detect(sglang_dir / "srt")
    assert v is not None and _install.unsupported(v) == [] and v.synchronous == (variant in ("kimi-k3-f8493a4", "online-live"))
    u = cli("uninstall", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert u.returncode == 0 and module.read_bytes() == STANDIN, _out(u)


def test_install_refuses_a_patch_that_calls_what_capture_arena_does_not_implement_in_real_sglang_wheel(
    sglang_dir: Path, tmp_path: Path
) -> None:
    sglang_patches.apply(sglang_dir, "unknown")
    (sglang_dir / "srt" / "spec_capture_sink.py").write_bytes(STANDIN)
    before = _snapshot(sglang_dir / "srt")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 2, _out(p)
    assert "does not implement spec_capture_sink.drain_live_records, sink.put_sample_stream" in p.stderr, p.stderr
    assert "not supported" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    _no_traceback(p)
    assert _snapshot(sglang_dir / "srt") == before, "nothing was written"


def test_install_refuses_a_patch_whose_sink_calls_it_cannot_find_in_real_sglang_wheel(sglang_dir: Path, tmp_path: Path) -> None:
    """A patch that initialises the sink where no call on it is found (SGLang moved the result
    processor): install went ahead, saying "SpecForge's unrecognised patch (...; no sink
    method)", so a method capture-arena lacks would have failed in the scheduler's loop."""
    sglang_patches.apply(sglang_dir, "no-sink-call")
    (sglang_dir / "srt" / "spec_capture_sink.py").write_bytes(STANDIN)
    before = _snapshot(sglang_dir / "srt")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 2 and "does not recognise this patch (no call on the sink in" in p.stderr, _out(p)
    _no_traceback(p)
    assert _snapshot(sglang_dir / "srt") == before, "nothing was written"


def test_an_install_run_again_removes_bytecode_a_failed_one_left_in_real_sglang_wheel(sglang_dir: Path, tmp_path: Path) -> None:
    """An install that wrote the shim and then could not remove the module's bytecode (a
    permission error) exits 2; run again it found the shim in place and returned at once, so
    the bytecode, which may shadow the shim, stayed for good."""
    sglang_patches.apply(sglang_dir, "v0.5.18")
    (sglang_dir / "srt" / "spec_capture_sink.py").write_bytes(STANDIN)
    assert cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path).returncode == 0
    cache = sglang_dir / "srt" / "__pycache__"
    cache.mkdir(exist_ok=True)
    left = cache / "spec_capture_sink.cpython-311.pyc"
    left.write_bytes(b"SpecForge's module, compiled")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 0 and "already installed" in p.stdout and not left.exists(), _out(p)


def test_install_refuses_when_the_scheduler_does_not_use_the_hook_module_in_real_sglang_wheel(
    sglang_dir: Path, tmp_path: Path
) -> None:
    # The hook module is there, but the scheduler was not patched (a patch applied in part).
    (sglang_dir / "srt" / "spec_capture_sink.py").write_bytes(STANDIN)
    before = _snapshot(sglang_dir / "srt")
    p = cli("install", "--sglang-dir", str(sglang_dir), cwd=tmp_path)
    assert p.returncode == 2 and "is not applied to the scheduler" in p.stderr, _out(p)
    _no_traceback(p)
    assert _snapshot(sglang_dir / "srt") == before
