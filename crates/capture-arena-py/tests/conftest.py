"""Shared fixtures: sinks with small arenas, closed after each test; SGLang's real wheels."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import capture_arena as ca

REPO = Path(__file__).resolve().parents[3]


def _scratch_tmp() -> None:
    """What the suites' processes leave in the temporary directory goes into one of this run's
    own, removed when the run ends: vLLM leaves an ipc socket per engine process
    (``VLLM_RPC_BASE_PATH``) and a ``vllm_dist_*`` file per engine in it (11 files a run in
    /tmp before, never removed). pytest-xdist's workers inherit the directory from the run's
    main process, which removes it. ``CAPTURE_ARENA_TEST_TMP`` names it for the processes the
    tests start. pytest's own tmp_path directories (2 GB a run: the unpacked sglang wheels)
    stay where pytest keeps and prunes them (its last three runs), and torch's compile cache
    where torch keeps it: removing them at the end cost the run 17 s here, 90 s on a loaded
    clean clone."""
    if os.environ.get("CAPTURE_ARENA_TEST_TMP"):
        return  # a worker of this run: the main process made it, and removes it
    import atexit
    import getpass
    import shutil

    base = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", base)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"torchinductor_{getpass.getuser()}"))
    d = tempfile.mkdtemp(prefix="ca-tests-", dir=base)
    os.environ["CAPTURE_ARENA_TEST_TMP"] = os.environ["TMPDIR"] = d
    tempfile.tempdir = d
    atexit.register(shutil.rmtree, d, ignore_errors=True)


_scratch_tmp()


def _wheel_cache() -> Path:
    env = os.environ.get("CAPTURE_ARENA_CACHE")
    return Path(env) if env else REPO / ".cache" / "sglang-wheel"


def sglang_wheel_of(version: str) -> Path:
    """The sglang wheel of ``version`` from PyPI, downloaded once into the cache
    (``$CAPTURE_ARENA_CACHE`` or ``<repo>/.cache/sglang-wheel``). No network is a failure, not a
    skip: CI has PyPI."""
    cache = _wheel_cache()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # One download at a time (pytest-xdist's workers share the cache), into a directory of its
    # own and then renamed into place: a wheel in the cache is always whole.
    with open(cache / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(cache.glob(f"sglang-{version}-*.whl"))
        if found:
            return found[0]
        with tempfile.TemporaryDirectory(dir=cache) as part:
            whl = _download(version, Path(part))
            whl.rename(cache / whl.name)
        return cache / whl.name


def _download(version: str, into: Path) -> Path:
    # One fixed file whatever this machine is (the tests only unzip it): pure-Python sources
    # plus a few extension modules that are never loaded.
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--only-binary=:all:", "--implementation", "cp", "--python-version", "3.11", "--abi", "cp311",
        "--platform", "manylinux_2_34_x86_64", f"sglang=={version}", "-d", str(into),
    ]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"could not download the sglang wheel ({' '.join(cmd)}): {e}", pytrace=False)
    found = sorted(into.glob(f"sglang-{version}-*.whl"))
    if p.returncode != 0 or not found:
        pytest.fail(
            f"could not download the sglang {version} wheel from PyPI (these tests need it; "
            f"put it in {_wheel_cache()} or set CAPTURE_ARENA_CACHE to a directory holding it):\n"
            f"$ {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}",
            pytrace=False,
        )
    return found[0]


@pytest.fixture(scope="session")
def sglang_tree(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tree(version)``: the real sglang wheel of that version unpacked (once a session): the
    directory that goes on PYTHONPATH. Copy it before changing it."""
    trees: dict[str, Path] = {}

    def tree(version: str) -> Path:
        if version not in trees:
            root = tmp_path_factory.mktemp(f"sglang-{version}-pristine")
            with zipfile.ZipFile(sglang_wheel_of(version)) as z:
                z.extractall(root)
            assert (root / "sglang" / "srt").is_dir(), f"sglang {version} has no sglang/srt"
            assert not (root / "sglang" / "srt" / "spec_capture_sink.py").exists(), "the wheel already has the hook module"
            trees[version] = root
        return trees[version]

    return tree


@pytest.fixture
def make_sink() -> Iterator[Callable[..., ca.ArenaSink]]:
    made: list[ca.ArenaSink] = []

    def make(**kw: Any) -> ca.ArenaSink:
        kw.setdefault("arena_bytes", "16MiB")
        kw.setdefault("wait_s", 5.0)
        s = ca.ArenaSink(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def spec(sample_id: str, L: int = 8, *, aux: bool = True, last: bool = True, replace: bool = False) -> dict[str, Any]:
    """A contract spec: aux -> hidden_state, last_hidden -> target, input_ids and loss_mask."""
    features = {}
    if aux:
        features["aux"] = "hidden_state"
    if last:
        features["last_hidden"] = "target"
    return {
        "store_id": "st",
        "sample_id": sample_id,
        "gen": 1,
        "replace": replace,
        "features": features,
        "passthrough": [
            {"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"},
            {"name": "loss_mask", "data": [1] * L, "shape": [1, L], "dtype": "int64"},
        ],
    }


def hidden(L: int, W: int, seed: int = 0) -> np.ndarray:
    """A bf16 [L, W] tensor with distinct values."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, W), dtype=np.float32).astype(ml_dtypes.bfloat16)


def wait_stats(sink: ca.ArenaSink, pred: Callable[[dict[str, int]], bool], timeout: float = 10.0) -> dict[str, int]:
    """Polls the sink's counters until `pred` holds."""
    deadline = time.monotonic() + timeout
    while True:
        s = sink.stats()
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


@pytest.fixture
def scheduler_module(sglang_tree: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``import_hook(variant, version="0.5.20")``: a copy of the real sglang wheel with
    ``variant``'s calls in its scheduler and result processor (``sglang_patches``), a hook module
    standing where SpecForge's patch puts it, ``python -m capture_arena.sglang install`` run on
    it, and ``sglang.srt.spec_capture_sink`` imported the way the patched scheduler imports it
    (the real package's ``srt``; ``sglang/__init__.py``, which needs SGLang's dependencies, is not
    run). Returns that module, which is ``capture_arena.sglang``; its sink is reset afterwards."""
    import importlib.util

    import sglang_patches
    from capture_arena import _install

    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}

    def import_hook(variant: str, version: str = "0.5.20") -> Any:
        root = sglang_patches.copy_tree(sglang_tree(version), tmp_path / f"site-{variant}-{version}")
        sglang_patches.apply(root / "sglang", variant)
        (root / "sglang" / "srt" / "spec_capture_sink.py").write_text(
            "# stands where SpecForge's hook module is\ndef maybe_init_sink(server_args):\n    pass\n\n\ndef get_sink():\n    pass\n"
        )
        assert _install.main(["install", "--sglang-dir", str(root / "sglang")]) == 0
        monkeypatch.syspath_prepend(str(root))
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        spec = importlib.util.find_spec("sglang")
        assert spec is not None and spec.origin is not None and spec.origin.startswith(str(root)), spec
        sys.modules["sglang"] = importlib.util.module_from_spec(spec)  # not executed
        return importlib.import_module("sglang.srt.spec_capture_sink")

    yield import_hook
    from capture_arena import sglang

    sglang.reset_sink()
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "queue(n): the live capture queue's size (SPEC_CAPTURE_LIVE_QUEUE) for the test's server")
    config.addinivalue_line("markers", "queue_bytes(n): the bytes the live capture queue may hold (SGLANG_SPEC_CAPTURE_LIVE_QUEUE_BYTES)")
    config.addinivalue_line("markers", "sync_wait(s): a synchronous caller's bound (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S)")
    config.addinivalue_line("markers", "proxy: the test's live server reaches its intake through a forward proxy (http_proxy)")


#: What a skip under ``CI=true`` may be for: a step that cannot exist on a machine without a GPU
#: (or that needs the GPU machine's own driver). Any other skip there is a failure: a package
#: that did not install must not pass as dozens of quietly skipped tests.
_CI_SKIPS_ALLOWED = ("CUDA", "GPU")


def _fail_a_ci_skip(report: Any) -> None:
    """Turns ``report`` (a test's or a module's) into a failure if it is a skip under ``CI=true``
    for anything but a missing GPU."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(word in reason for word in _CI_SKIPS_ALLOWED):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which fails unless the step cannot exist without a GPU: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    _fail_a_ci_skip(report)
    setattr(item, f"rep_{report.when}", report)  # what a fixture's teardown asks: did the test fail?


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    # A module skipped whole (a module-level importorskip: torch, specforge, vLLM) too.
    outcome = yield
    _fail_a_ci_skip(outcome.get_result())
