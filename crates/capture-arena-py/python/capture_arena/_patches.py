"""Which of SpecForge's published SGLang patches an installation has, read from its files.

:func:`detect` reads what the patched scheduler and its result processor import from
``sglang.srt.spec_capture_sink`` and call on it and on its sink; it never imports SGLang. Used by
the hook module (:mod:`capture_arena.sglang`, to pick its defaults) and by its installer
(:mod:`capture_arena._install`, to refuse a patch it cannot serve).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Optional

__all__ = ["Variant", "detect"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a patched SGLang asks of the hook module (see :func:`detect`)."""

    #: Which published patch this is (or family of them).
    name: str
    #: The scheduler thread calls ``put_sample`` itself and waits for it.
    synchronous: bool
    #: Module-level names it imports or calls (``maybe_init_sink``, ``gpu_put_enabled``, ...).
    module_names: tuple[str, ...]
    #: Methods it calls on ``get_sink()``'s sink (``submit_samples``, ``put_sample``, ...).
    sink_methods: tuple[str, ...]
    #: The files that use the hook module, relative to ``srt/``.
    files: tuple[str, ...]

    def missing(self, mod: ModuleType, sinks: Sequence[type]) -> list[str]:
        """The names the hook module ``mod`` (capture_arena.sglang) and its ``sinks`` lack, as
        ``spec_capture_sink.name`` / ``sink.name``."""
        out = [f"spec_capture_sink.{n}" for n in self.module_names if not callable(getattr(mod, n, None))]
        out += [f"sink.{n}" for n in self.sink_methods if not all(callable(getattr(c, n, None)) for c in sinks)]
        return out

    def describe(self) -> str:
        calls = ", ".join(self.module_names)
        methods = ", ".join(f"sink.{m}" for m in self.sink_methods) or "no sink method"
        return f"SpecForge's {self.name} patch ({', '.join(self.files)} use {calls}; {methods})"


#: How a patched file reaches the hook module.
_FROM_IMPORT = re.compile(r"from\s+sglang\.srt\.spec_capture_sink\s+import\s+(?:\(([^)]*)\)|([\w \t,]+))")
_MODULE_IMPORT = re.compile(r"from\s+sglang\.srt\s+import\s+spec_capture_sink\b|import\s+sglang\.srt\.spec_capture_sink\b")
_MODULE_CALL = re.compile(r"\bspec_capture_sink\.(\w+)\b")
_SINK_CALL = re.compile(r"\bsink\.(\w+)\(")
#: Files of ``srt/`` the patches change to call the hook module (the scheduler, its result
#: processor: a mixin in older SGLang, a component since 0.5.14).
_PATCHED_GLOBS = ("managers/*.py", "managers/scheduler_components/*.py")
#: The longest file read (SGLang's scheduler is about 150 KB).
_MAX_SOURCE = 8 << 20


def detect(srt: Path) -> Optional[Variant]:
    """Which SpecForge patch the SGLang at ``srt`` has, read from what its scheduler and result
    processor import from ``sglang.srt.spec_capture_sink`` and call on it and on the sink
    ``get_sink()`` returns; None when nothing there uses the hook module (the patch is not
    applied). Read only, never imports SGLang."""
    module: dict[str, None] = {}
    methods: dict[str, None] = {}
    files: list[str] = []
    texts: dict[str, str] = {}
    for pattern in _PATCHED_GLOBS:
        for f in sorted(srt.glob(pattern)):
            try:
                if f.stat().st_size > _MAX_SOURCE:
                    continue
                text = f.read_text("utf-8", "replace")
            except OSError:
                continue
            uses = False
            for m in _FROM_IMPORT.finditer(text):
                uses = True
                for n in (m.group(1) or m.group(2)).split(","):
                    if n.strip():
                        module[n.split()[0]] = None
            if _MODULE_IMPORT.search(text):
                uses = True
                for m in _MODULE_CALL.finditer(text):
                    module[m.group(1)] = None
            if uses:
                rel = str(f.relative_to(srt))
                files.append(rel)
                texts[rel] = text
                if "get_sink" in text:
                    for m in _SINK_CALL.finditer(text):
                        methods[m.group(1)] = None
    if not files:
        return None
    names, calls = tuple(module), tuple(methods)
    scheduler = texts.get("managers/scheduler.py", "")
    if "maybe_live_spec" in names or "put_sample_live" in calls:
        name, sync = "online-live (live capture, a layer over the synchronous v0.5.14 patch)", True
    elif "submit_samples" in calls and "gpu_put_enabled" in names:
        if 'getattr(self, "batch_result_processor"' in scheduler:
            name = "v0.5.20 (asynchronous, device publication)"
        else:
            name = "main-923e4a56 (asynchronous, device publication)"
        sync = False
    elif "submit_samples" in calls:
        name, sync = "v0.5.18 / v0.5.14 / kimi-k3 main (asynchronous, host staging)", False
    elif "put_sample" in calls or "put_samples" in calls:
        name, sync = "kimi-k3-f8493a4 / early v0.5.14 (synchronous put_sample on the scheduler thread)", True
    else:
        name, sync = "unrecognised", False
    return Variant(name, sync, names, calls, tuple(files))
