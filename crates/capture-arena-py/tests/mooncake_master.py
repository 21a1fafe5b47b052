"""Mooncake for the tests: whether it is importable (``needs_mooncake``), and starting and stopping a
``mooncake_master`` on loopback ports of its own (the store tests and
``benches/bench_mooncake.py``)."""

from __future__ import annotations

import importlib
import pathlib
import socket
import subprocess
import time

import pytest


try:
    MOONCAKE_ENGINE = importlib.import_module("mooncake.engine")
    MISSING = ""
except ImportError as e:  # pragma: no cover - the test command installs it
    MOONCAKE_ENGINE = None
    MISSING = f"Mooncake is not importable here ({e}); scripts/test.sh installs it"


# Skips a test (or, as `pytestmark`, a module), saying why, where Mooncake cannot be imported.
needs_mooncake = pytest.mark.skipif(MOONCAKE_ENGINE is None, reason=MISSING or "n/a")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start() -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A running master (with its HTTP metadata server) and the ``MOONCAKE_*`` variables that
    reach it; stop it with :func:`stop`. Ready once all three of its ports accept: a port another
    process took after :func:`free_port` let it go ends the master (its RPC port may already
    accept by then), and it is started again on new ports, up to three times."""
    import mooncake

    why = ""
    for _ in range(3):
        rpc, http, metrics = free_port(), free_port(), free_port()
        p = subprocess.Popen(
            [
                str(pathlib.Path(mooncake.__file__).parent / "mooncake_master"),
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 30
        waiting = [rpc, http, metrics]
        while waiting and p.poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", waiting[0]), timeout=0.2).close()
                waiting.pop(0)
            except OSError:
                time.sleep(0.05)
        if not waiting and p.poll() is None:
            return p, {
                "MOONCAKE_PROTOCOL": "tcp",
                "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{rpc}",
                "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{http}/metadata",
                "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
                "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            }
        why = f"exit {p.poll()}, ports {waiting} not accepting"
        stop(p)
    raise RuntimeError(f"mooncake_master did not start in 3 tries ({why})")


def stop(p: subprocess.Popen[bytes]) -> None:
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


__all__ = ["start", "stop", "free_port", "needs_mooncake", "MOONCAKE_ENGINE"]
