"""What each published SpecForge SGLang patch adds to SGLang's scheduler and result processor, as
far as the hook module sees it: its imports of ``sglang.srt.spec_capture_sink`` and its calls into
it and into the sink ``get_sink()`` returns. Our own code, written for these tests from reading the
patches (``patches/sglang/{v0.5.18,v0.5.20,main-923e4a56,kimi-k3-f8493a4}/spec-capture.patch`` and
``patches/sglang/online-live/spec-capture-live.patch`` in sgl-project/SpecForge); the patches
themselves are not in this tree.

:func:`apply` appends a variant's additions to the real wheel's ``managers/scheduler.py`` and
``managers/scheduler_components/batch_result_processor.py`` (module-level functions, so the files
still parse); ``python -m capture_arena.sglang install`` reads those files to tell the variants
apart.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SCHEDULER = "managers/scheduler.py"
PROCESSOR = "managers/scheduler_components/batch_result_processor.py"

# Scheduler.__init__, every patch: the hook module imported where capture is on, every rank.
_INIT = '''

def _spec_capture_init(self, server_args):  # SpecForge patch: Scheduler.__init__
    if server_args.enable_spec_capture:
        if server_args.chunked_prefill_size != -1:
            raise ValueError("--enable-spec-capture requires --chunked-prefill-size -1")
        from sglang.srt import spec_capture_sink

        spec_capture_sink.maybe_init_sink(server_args)
'''

# v0.5.20 and main: device publication decided per batch, the pending captures drained when idle.
_GPU_PUT_SCHEDULER = '''

def _should_copy_hidden_states_to_cpu(self, batch):  # SpecForge patch (v0.5.20, main)
    from sglang.srt.spec_capture_sink import gpu_put_enabled

    return batch.return_hidden_states and (
        (self.ps.attn_tp_rank == 0 and not gpu_put_enabled()) or any(req.spec_capture is None for req in batch.reqs)
    )


def _should_capture_hidden_states_on_device(self, batch):
    from sglang.srt.spec_capture_sink import gpu_put_enabled

    return self.ps.attn_tp_rank == 0 and gpu_put_enabled() and any(req.spec_capture is not None for req in batch.reqs)
'''
_V0520_IDLE = '''

def _spec_capture_on_idle(self):  # v0.5.20: upstream unit tests drive on_idle on a bare stub
    processor = getattr(self, "batch_result_processor", None)
    if processor is not None:
        processor.drain_spec_captures()
'''
_MAIN_IDLE = '''

def _spec_capture_on_idle(self):  # main-923e4a56
    self.batch_result_processor.drain_spec_captures()
'''

# The asynchronous processors (v0.5.14 since August, v0.5.18, v0.5.20, main, kimi-k3's main).
_ASYNC_PROCESSOR = '''

def _queue_spec_captures(self, pending):  # SpecForge patch: one submit per scheduler batch
    from sglang.srt import spec_capture_sink

    sink = spec_capture_sink.get_sink()
    future = sink.submit_samples([(spec, aux, last_hidden) for _, spec, aux, last_hidden in pending])
    self._spec_capture_batches.append((pending, future))


def drain_spec_captures(self):
    while self._spec_capture_batches:
        pending, future = self._spec_capture_batches.pop(0)
        try:
            results = future.result()
        except Exception as e:
            results = [{"sample_id": spec.get("sample_id"), "error": str(e)} for _, spec, _, _ in pending]
        for (req, _, _, _), result in zip(pending, results):
            req.spec_capture_result = result
'''
_GPU_PUT_PROCESSOR = '''

def _append_spec_capture_states(self, req, captured):  # v0.5.20, main: device tensors kept
    from sglang.srt.spec_capture_sink import gpu_put_enabled

    if gpu_put_enabled() and not captured.is_cuda:
        raise RuntimeError("GPU capture reached the sink after CPU staging")
    req.spec_capture_aux.append(captured)
'''

# The synchronous processor (kimi-k3 at f8493a4, v0.5.14 in July): put_sample on the scheduler
# thread, inside a try.
_SYNC_PROCESSOR = '''

def _sink_spec_capture(self, req):  # SpecForge patch: synchronous put on the scheduler thread
    from sglang.srt import spec_capture_sink

    sink = spec_capture_sink.get_sink()
    if sink is None or self.output_streamer.ps.attn_tp_rank != 0:
        return
    aux = req.spec_capture_aux[0] if req.spec_capture_aux else None
    last_hidden = req.spec_capture_last_hidden[0] if req.spec_capture_last_hidden else None
    try:
        req.spec_capture_result = sink.put_sample(req.spec_capture, aux=aux, last_hidden=last_hidden)
    except Exception as e:
        req.spec_capture_result = {"sample_id": req.spec_capture.get("sample_id"), "error": str(e)}
'''

# online-live: a module-level import in the scheduler, a live spec minted per request, and the
# live branch before the synchronous put.
_LIVE_SCHEDULER = '''

from sglang.srt import spec_capture_sink


def _spec_capture_for(recv_req):  # online-live: Req(..., spec_capture=...)
    return recv_req.spec_capture or spec_capture_sink.maybe_live_spec(recv_req.rid)
'''
_LIVE_PROCESSOR = '''

def _sink_spec_capture_live(self, req, aux, last_hidden):  # online-live: before the base put
    from sglang.srt import spec_capture_sink

    sink = spec_capture_sink.get_sink()
    if req.spec_capture.get("live"):
        tokens = list(req.origin_input_ids) + list(req.output_ids)[:-1]
        sink.put_sample_live(req.spec_capture, aux=aux, last_hidden=last_hidden, tokens=tokens)
        return
'''

# A variant capture-arena does not implement: names it has never heard of.
_UNKNOWN_PROCESSOR = '''

def _sink_spec_capture(self, req):  # not a published patch
    from sglang.srt import spec_capture_sink

    sink = spec_capture_sink.get_sink()
    spec_capture_sink.drain_live_records()
    sink.put_sample_stream(req.spec_capture, chunks=req.spec_capture_aux)
'''

#: variant -> (scheduler additions, processor additions)
VARIANTS: dict[str, tuple[str, str]] = {
    "v0.5.18": (_INIT, _ASYNC_PROCESSOR),
    "v0.5.20": (_INIT + _GPU_PUT_SCHEDULER + _V0520_IDLE, _ASYNC_PROCESSOR + _GPU_PUT_PROCESSOR),
    "main-923e4a56": (_INIT + _GPU_PUT_SCHEDULER + _MAIN_IDLE, _ASYNC_PROCESSOR + _GPU_PUT_PROCESSOR),
    "kimi-k3-f8493a4": (_INIT, _SYNC_PROCESSOR),
    "online-live": (_INIT + _LIVE_SCHEDULER, _LIVE_PROCESSOR + _SYNC_PROCESSOR),
    "unknown": (_INIT, _UNKNOWN_PROCESSOR),
    # The hook module imported and initialised, and no call on the sink where the patches make
    # them (the result processor moved elsewhere, say).
    "no-sink-call": (_INIT, ""),
}

#: What ``install`` must say it found, per variant.
FOUND = {
    "v0.5.18": "v0.5.18 / v0.5.14 / kimi-k3 main (asynchronous, host staging)",
    "v0.5.20": "v0.5.20 (asynchronous, device publication)",
    "main-923e4a56": "main-923e4a56 (asynchronous, device publication)",
    "kimi-k3-f8493a4": "kimi-k3-f8493a4 / early v0.5.14 (synchronous put_sample on the scheduler thread)",
    "online-live": "online-live (live capture, a layer over the synchronous v0.5.14 patch)",
}


def apply(sglang_dir: Path, variant: str) -> None:
    """Adds ``variant``'s calls to the scheduler and its result processor under ``sglang_dir``
    (the ``sglang`` package directory of an unpacked wheel)."""
    scheduler, processor = VARIANTS[variant]
    for rel, text in ((SCHEDULER, scheduler), (PROCESSOR, processor)):
        path = sglang_dir / "srt" / rel
        assert path.is_file(), f"the wheel has no {rel}"
        patched = path.read_text("utf-8") + text
        path.unlink()  # a copy may share the file with the pristine tree (a hard link)
        path.write_text(patched, "utf-8")


def copy_tree(src: Path, dst: Path) -> Path:
    """A copy of an unpacked wheel made of hard links (fast; 0.5.23 is 87 MB): write a file
    only by replacing it (as :func:`apply` and ``install`` do)."""
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
    return dst
