"""NIXL's environment, set once when the package is imported, before NIXL's library loads."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from ._capture_arena import FEATURES, UCX_TCP_SEG_SIZE


def _infiniband_devices() -> int:
    """How many InfiniBand devices this machine shows (-1: it cannot be told, such as a
    ``/sys`` this process may not list: then UCX is left as it is)."""
    try:
        return len(os.listdir("/sys/class/infiniband"))
    except FileNotFoundError:
        return 0
    except OSError:
        return -1


def _nixl_defaults() -> None:
    """NIXL's environment, set before its library loads (on the first ``nixl://`` session):
    ``SGLANG_SPEC_CAPTURE_NIXL_LIB`` from an installed ``nixl-cu12`` wheel when unset,
    ``UCX_MODULES=^ib`` where the machine has no InfiniBand device (UCX's InfiniBand module
    crashes at exit there, in the libnl the wheel bundles), UCX's TCP segment size, and the NIXL
    server process (``SGLANG_SPEC_CAPTURE_NIXL_SERVER``)."""
    if "nixl" not in FEATURES:
        return
    if not os.environ.get("SGLANG_SPEC_CAPTURE_NIXL_LIB"):
        spec = importlib.util.find_spec("nixl_cu12")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            libs = os.path.join(os.path.dirname(loc), ".nixl_cu12.mesonpy.libs")
            if os.path.exists(os.path.join(libs, "libnixl_capi.so")):
                os.environ["SGLANG_SPEC_CAPTURE_NIXL_LIB"] = libs
                break
    if "UCX_MODULES" not in os.environ and _infiniband_devices() == 0:
        os.environ["UCX_MODULES"] = "^ib"
    # Over TCP a READ comes back in segments of this size (UCX's default, 8 KiB, made reads across
    # hosts 0.58 x a Mooncake TransferEngine's; 512 KiB: 2.3 x). Both sides need the same value.
    for var in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
        os.environ.setdefault(var, UCX_TCP_SEG_SIZE)
    # A host arena's READs are served by a process of its own (UCX can abort the process it runs
    # in: that must not be SGLang's); ``inline`` serves them in this process.
    os.environ.setdefault("SGLANG_SPEC_CAPTURE_NIXL_SERVER", json.dumps([sys.executable, "-m", "capture_arena._nixl_serve"]))


_nixl_defaults()
