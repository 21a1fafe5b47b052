"""The two halves of capture-arena's vLLM connector in processes of their own, driven over
stdin/stdout by test_vllm.py (one JSON command a line, one JSON answer a line), so that a test
can run them out of order and fault either one: the scheduler process's half (the engine core's)
and the worker's, or both in one process.

vLLM's classes and the connector are real; only the model runner's plumbing is replaced (which
layer is the cache-only one, the tensor-parallel rank) and the scheduler's (a KV cache manager
that gives every request blocks 0.., requests reduced to the fields the connector reads).

Usage: python vllm_halves.py ROLE ENGINE_ID ARENA_BYTES   (ROLE: scheduler, worker or both)

The cache is ``[64 blocks, 2 layers, 16 slots, 64]`` bf16: a token is 256 bytes of hidden
states and 8 of its id. Commands:
- ``{"announce": [[rid, n_tokens], ...], "embeds": [rid, ...]}`` (scheduler; ``embeds``: those
  requests have no prompt token ids, as prompt embeddings) -> ``{"meta": base64, "seqs": {rid:
  n}, "s": seconds}``: one step's metadata, pickled as vLLM sends it to the workers, each
  announcement's number, and the time build_connector_meta took;
- ``{"save": base64}`` (worker) -> ``{"s": seconds}``: that step's bind_connector_metadata and wait_for_save;
- ``{"bind": base64}`` (worker): only bind that step (its forward would run now); ``{"unsaved":
  1}``: end it without wait_for_save; ``{"get_finished": [rid, ...]}``: the worker's get_finished;
- ``{"finish": rid, "gap": bool, "abort": bool, "status": name}`` (scheduler) -> ``{"params": ...,
  "s": seconds}``: request_finished (``abort``: of a request vLLM aborted; ``status``: its
  RequestStatus by name); with ``gap`` (both in one process) the connector's condition is instrumented
  so that, once its timed wait ran out and it releases the lock, a result for that request is
  sent by the worker and read before request_finished goes on;
- ``{"break_rows": why, "panic": bool}`` (worker): the copy's setup (``_Rows``) raises ``why``
  (a BaseException with ``panic``, as a panic in native code) for every step from now on,
  ``{"break_rows": null}`` mends it; ``{"break_finish": n}`` (worker): the next n failings of a
  step's objects raise such a panic once they are done; ``{"stop_copier": true}`` (worker): the copy
  thread is stopped as the sink's closing stops it (the sink left open; ``"none_yet"``: as a
  close before any step started one), ``{"restart_copier":
  true}``: the next step starts a new one; ``{"break_publish": [n, when]}`` (worker): the next
  n hand-overs of a step raise, before their reservations are collected (as
  ``torch.cuda.Event()`` in a failed CUDA context would) or after (``"collected"``);
  ``{"stop_in_save": base64}`` (worker): that step is
  saved, and the copy thread stopped so (on a thread of its own) in the midst of its
  wait_for_save, between its look at whether the sink is closing and its hand-over of the step;
  ``{"fail_thread_start": [name, n]}``: the next n starts of threads of that name fail as at
  the process's limit; ``{"gate_copies": bool}`` (worker): from the next step, copies wait once begun (their requests
  marked started) until the gate opens (false); ``{"preempt_grace": s}`` (worker):
  ``PREEMPT_GRACE_S``; ``{"handle_preemptions": base64}`` (worker) -> ``{"s": seconds}``: that
  step's handle_preemptions;
- ``{"unpins": true}`` (worker) -> ``{"unpins": n}``: how many times the copy's rows unpinned
  the host arena (``_Rows.unpin``: a device cache's; a no-op for this host cache);
- ``{"threads": true}`` -> ``{"threads": {name: stack}}``: the end of each thread's stack;
- ``{"reset": true}`` (scheduler) -> ``{"ok": bool, "s": seconds, "at": monotonic}``: the
  connector's reset_cache (as vLLM's reset of its caches calls it before discarding the cache),
  what it returned, how long it took and when it returned;
- ``{"fill_fds": true}`` / ``{"release_fds": true}`` (scheduler): takes every free descriptor of
  the process, then gives them back;
- ``{"stats": true}`` (worker): the worker's arena counters; ``{"reconnect": true}`` (worker):
  the next results go over a new connection (the current one is given up, as after a failed
  send); ``{"hold_answers": bool}`` (worker): its connections' readers read nothing more until
  released or their connection is given up; ``{"queued": true}`` (worker): the bytes of answers
  waiting unread in its current connection; ``{"fail_sends": ["half" | "none", ...]}`` (worker):
  its next sends of results time out, after the first half of their lines arrived and were answered
  (``half``) or at once (``none``); ``{"fail_reports": n}`` (worker): its next n sends of a
  report of copies over time out at once; ``{"reports_sent": true}`` (worker): how many reports
  of copies over were sent whole so far; ``{"finished_sending": [rid, ...]}`` (scheduler):
  vLLM's update_connector_output with the copies the worker reported done;
  ``{"accept_errors": true}``
  (scheduler): the listener's failed accepts; ``{"peers": true}`` (scheduler): the pids of the
  workers it has a connection of; ``{"max_pending": n}`` (scheduler): the table of
  announced requests holds n; ``{"send_timeout": s}`` (scheduler): the connections it accepts
  from now on wait up to s for room in a send (``ACK_GRACE_S / 4``; 0.5 unless set);
  ``{"first_line_s": s}`` (scheduler): ``FIRST_LINE_S`` for the connections it accepts from now
  on; ``{"hold_delivery": bool}`` (scheduler): every line the listener reads from now on waits
  between its read and its delivery (a listener thread held up) until released (false);
  ``{"delayed": true}``: how many such lines were delivered so far (``"delayed"``) and how many
  were read, to be held (``"read"``);
  ``{"defer": [pid, n]}`` (scheduler): n made-up keys wait among
  the frees for that worker process's next connection; ``{"stall_idle": s}`` (worker): the
  answers reader of its next connection is held up s once, after a read that timed out;
  ``{"shutdown": true}`` (worker): vLLM's shutdown of the worker's connector.
"""

import base64
import json
import os
import pickle
import sys
import threading
import time
from types import SimpleNamespace as ns

import torch
import vllm.config
import vllm.distributed.parallel_state as ps
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from capture_arena.vllm import CaptureArenaConnector



#: What ``creating_arena`` swapped out: the worker's sink and bound, the one swapped in, its gate.
SWAPPED: list = []


class SimulatedPanic(BaseException):
    """Raised where native code would panic (PyO3's PanicException is a BaseException)."""


role, engine_id, arena_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
if role == "scheduler":  # few enough descriptors to take them all (fill_fds)
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

vllm.config.get_layers_from_vllm_config = lambda cfg, kind, names: {n: None for n in names}
ps.get_tensor_model_parallel_rank = lambda: 0
BLOCKS, LAYERS, SLOTS, HIDDEN = 64, 2, 16, 64
cfg = ns(
    kv_transfer_config=ns(engine_id=engine_id, kv_connector_extra_config={"arena_bytes": arena_bytes}),
    parallel_config=ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="mp", world_size=1),
    speculative_config=ns(method="extract_hidden_states", draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1, 2]))),
)
sched = worker = None
delayed = {"done": 0, "read": 0}
delivery_gate = threading.Event()  # cleared by hold_delivery: read lines wait to be delivered
delivery_gate.set()
held_deliver = []  # the listener's delivery, while hold_delivery holds it
requests = {}
if role in ("scheduler", "both"):
    sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=SLOTS))]))
    sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: (list(range(BLOCKS)),), block_pool=None))
if role in ("worker", "both"):
    import socket as _socket
    import types

    import capture_arena.vllm

    hold = threading.Event()  # the worker's answers readers read nothing while set...
    given_up = set()  # ...but for those of connections it gave up

    fail_sends = []  # how the worker's next sends fail: "half" or "none" each
    fail_reports = [0]  # how many of the worker's next reports of copies over fail

    # How many times the copy's rows were unpinned (a device cache's host arena; a no-op here).
    unpins = [0]
    _real_unpin = capture_arena.vllm._Rows.unpin

    def _counted_unpin(self):
        unpins[0] += 1
        return _real_unpin(self)

    capture_arena.vllm._Rows.unpin = _counted_unpin

    def _queued(sock):
        import fcntl
        import termios

        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)

    class _HeldSocket(_socket.socket):
        def recv(self, n, *flags):
            while hold.is_set() and self not in given_up:
                time.sleep(0.001)
            return super().recv(n, *flags)

        def sendall(self, data, *flags):
            if data.startswith(b'{"over"') and fail_reports[0] > 0:
                fail_reports[0] -= 1
                raise _socket.timeout("timed out (the test's)")
            # Only sends of results (a copy thread's report of copies over goes as it would).
            how = fail_sends.pop(0) if fail_sends and not data.startswith(b'{"over"') else None
            if how == "half":  # the first half of its lines arrive, and are answered
                lines = data.split(b"\n")[:-1]
                super().sendall(b"".join(line + b"\n" for line in lines[: (len(lines) + 1) // 2]), *flags)
                deadline = time.monotonic() + 10
                while _queued(self) == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
            if how is not None:
                raise _socket.timeout("timed out (the test's)")
            return super().sendall(data, *flags)

    capture_arena.vllm.socket = types.SimpleNamespace(**{**vars(_socket), "socket": _HeldSocket})
    worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
    _drop_conn = worker._drop_conn

    def _record_drop(conn=None):
        c = worker._conn
        _drop_conn(conn)
        if c is not None and worker._conn is not c:
            given_up.add(c)

    worker._drop_conn = _record_drop
    reports_sent = [0]  # reports of copies over sent whole on the result channel
    _send_whole = worker._send_whole

    def _counted_send_whole(*a):
        e = _send_whole(*a)
        if e is None:
            reports_sent[0] += 1
        return e

    worker._send_whole = _counted_send_whole
    worker.register_kv_caches({"drafter.cache_only": torch.randn(BLOCKS, LAYERS, SLOTS, HIDDEN).to(torch.bfloat16)})
    deadline = time.monotonic() + 60
    while not worker._sink.started:  # the arena is made in the background as the engine starts
        assert time.monotonic() < deadline, "the worker's arena was not made in 60 s"
        time.sleep(0.01)
held_fds = []


def save(meta_b64):
    meta = pickle.loads(base64.b64decode(meta_b64))
    t0 = time.monotonic()  # the step's hooks on vLLM's thread: bind (it begins the reservations) to wait_for_save
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    took = time.monotonic() - t0
    worker.clear_connector_metadata()
    return took


class GapCondition(threading.Condition):
    """The scheduler's condition, instrumented: when request_finished's timed wait for ``rid``
    has run out and it releases the lock, the worker hands the result over (from another
    thread) before request_finished may go on."""

    def __init__(self, meta_b64):
        super().__init__()
        self.meta_b64 = meta_b64
        self.timed_out = False
        self.delivered = threading.Event()
        self.saver = None  # the thread it starts to hand the result over

    def wait(self, timeout=None):
        got = super().wait(timeout)
        if not got and timeout is not None:
            self.timed_out = True
        return got

    def __exit__(self, *exc):
        me = threading.current_thread()
        r = super().__exit__(*exc)
        if me is self.saver:  # not another thread's (a copy thread reporting copies over)
            self.delivered.set()  # the hand-over (or its refusal) is done
        elif me is main and self.timed_out and self.meta_b64 is not None:
            meta, self.meta_b64 = self.meta_b64, None
            self.saver = threading.Thread(target=save, args=(meta,), daemon=True)
            self.saver.start()
            self.delivered.wait(10)
        return r


main = threading.main_thread()
copy_gate = threading.Event()
print(json.dumps({"ready": True}), file=answers, flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        if "announce" in cmd:
            num = {}
            for rid, n in cmd["announce"]:
                ids = None if rid in cmd.get("embeds", ()) else list(range(1, n + 1))  # prompt embeddings: no ids
                req = ns(request_id=rid, num_computed_tokens=0, num_prompt_tokens=n, prompt_token_ids=ids)
                requests[rid] = req
                sched.on_new_request(req)
                num[rid] = n
            t0 = time.monotonic()
            meta = sched.build_connector_meta(ns(num_scheduled_tokens=num, preempted_req_ids=set(cmd.get("preempt", ()))))
            took = time.monotonic() - t0
            answer = {"meta": base64.b64encode(pickle.dumps(meta)).decode(), "seqs": {sv.req_id: sv.seq for sv in meta.saves}, "s": took}
        elif "save" in cmd:
            answer = {"s": save(cmd["save"])}
        elif "bind" in cmd:  # a step bound (its forward running), not saved yet
            worker.bind_connector_metadata(pickle.loads(base64.b64decode(cmd["bind"])))
            answer = {"ok": True}
        elif "unsaved" in cmd:  # the bound step ends without wait_for_save
            worker.clear_connector_metadata()
            answer = {"ok": True}
        elif "get_finished" in cmd:  # vLLM's worker asks which finished requests' blocks may go
            done, _ = worker.get_finished(set(cmd["get_finished"]))
            answer = {"done": sorted(done or ())}
        elif "finish" in cmd:
            if cmd.get("gap"):
                sched._cond = GapCondition(cmd["gap"])
            req = requests.pop(cmd["finish"])
            if cmd.get("abort"):  # as vLLM finishes a request its client went away from
                req.status = ns(name="FINISHED_ABORTED")
            if cmd.get("status"):  # as vLLM finishes one it failed (FINISHED_ERROR)
                req.status = ns(name=cmd["status"])
            t0 = time.monotonic()
            params = sched.request_finished(req, [])[1]
            answer = {"params": params, "s": time.monotonic() - t0}
        elif "reset" in cmd:
            t0 = time.monotonic()
            ok = sched.reset_cache()
            answer = {"ok": ok, "s": time.monotonic() - t0, "at": time.monotonic()}
        elif "fill_fds" in cmd:
            while True:
                try:
                    held_fds.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            answer = {"held": len(held_fds)}
        elif "release_fds" in cmd:
            for fd in held_fds:
                os.close(fd)
            held_fds.clear()
            answer = {"ok": True}
        elif "stats" in cmd:
            answer = dict(worker._sink.stats())
        elif "threads" in cmd:  # this process's threads, each with the end of its stack
            import traceback

            answer = {
                "threads": {
                    t.name: "".join(traceback.format_stack(sys._current_frames()[t.ident])[-4:])
                    for t in threading.enumerate() if t.ident in sys._current_frames()
                }
            }
        elif "debug" in cmd:  # what a failed test reports: the worker's threads and waiting results
            import traceback

            now = time.monotonic()
            answer = {
                "unacked": {t: round(d - now, 3) for t, (_, d, *_) in worker._unacked.items()},
                "conn": None if worker._conn is None else worker._conn.fileno(),
                "threads": {
                    t.name: "".join(traceback.format_stack(sys._current_frames()[t.ident])[-4:])
                    for t in threading.enumerate() if t.ident in sys._current_frames()
                },
            }
        elif "break_rows" in cmd:
            import capture_arena.vllm

            if not hasattr(capture_arena.vllm, "_real_rows"):
                capture_arena.vllm._real_rows = capture_arena.vllm._Rows
            why = cmd["break_rows"]

            panic = bool(cmd.get("panic"))

            def _broken(*a, why=why, panic=panic):
                raise (SimulatedPanic if panic else RuntimeError)(why)

            capture_arena.vllm._Rows = capture_arena.vllm._real_rows if why is None else _broken
            worker._rows = None  # made again by the next step
            answer = {"ok": True}
        elif "break_finish" in cmd:  # the next n failings of objects raise as a panic would
            left, real_finish = [int(cmd["break_finish"])], type(worker._sink)._finish_keys

            def _finish_keys(keys, ok=True, left=left, real=real_finish, sink=worker._sink):
                real(sink, keys, ok)  # failed all the same: the arena is left as it would be
                if not ok and left[0] > 0:
                    left[0] -= 1
                    raise SimulatedPanic("simulated: failing the step's objects panicked")

            worker._sink._finish_keys = _finish_keys
            answer = {"ok": True}
        elif "break_publish" in cmd:  # the next hand-over raises: before its reservations are collected
            # (as torch.cuda.Event() in a failed CUDA context would), or after ("collected")
            n, when, *panic = cmd["break_publish"]
            left = [int(n)]
            raised = SimulatedPanic if panic and panic[0] else RuntimeError
            if when == "reserving":  # the reservations' begin at bind, as a panic of the extension would
                sink = worker._sink
                real_begin = type(sink)._begin_reserving_rows

                def _begin_rows(*a, real=real_begin, sink=sink, left=left, raised=raised):
                    if left[0] > 0:
                        left[0] -= 1
                        raise raised("simulated: reserving the step's rows panicked")
                    return real(sink, *a)

                sink._begin_reserving_rows = _begin_rows
            elif when == "collected":
                real_hand = worker._hand_in_process

                def _hand(sched, saves, reserved, real=real_hand, left=left, raised=raised):
                    if left[0] > 0 and reserved and reserved[0][0] is not None:
                        left[0] -= 1
                        raise raised("simulated: handing the results over failed")
                    return real(sched, saves, reserved)

                worker._hand_in_process = _hand
            else:
                real_publish = worker._publish

                def _publish(saves, reservations, *a, real=real_publish, left=left, raised=raised):
                    if left[0] > 0 and not isinstance(reservations, str):
                        left[0] -= 1
                        raise raised("simulated: CUDA error: an illegal memory access was encountered")
                    return real(saves, reservations, *a)

                worker._publish = _publish
            answer = {"ok": True}
        elif "break_mark_done" in cmd:  # the copy thread's next n marks of a step's copies over raise once done (the thread ends)
            left, real_mark = [int(cmd["break_mark_done"])], worker._mark_done

            def _mark(copies, report=True, real=real_mark, left=left):
                real(copies, report=report)
                # The step's end (report=True, in the loop's finally), not a request's own mark.
                if left[0] > 0 and report and threading.current_thread().name == "capture-arena-vllm-copy":
                    left[0] -= 1
                    raise SimulatedPanic("simulated: marking a step's copies over failed")

            worker._mark_done = _mark
            answer = {"ok": True}
        elif "creating_arena" in cmd:  # the worker's sink swapped for one whose first start failed and whose next try runs (until false); its bound made 10 s
            if cmd["creating_arena"]:
                from capture_arena import ArenaSink

                gate, tries = threading.Event(), []
                creating = ArenaSink(arena_bytes=1 << 20)

                def _start(*a, gate=gate, tries=tries, **k):
                    tries.append(1)
                    if len(tries) == 1:
                        raise RuntimeError("simulated: out of memory")
                    gate.wait(60)  # under way until the gate opens

                creating._ensure_started = _start
                creating.start_in_background()
                deadline = time.monotonic() + 20
                while (creating._start_error is None or creating._starter is not None) and time.monotonic() < deadline:
                    time.sleep(0.01)  # failed, and its thread done with it
                creating._start_failed_at -= 60  # START_RETRY_S has passed: the next capture tries again
                SWAPPED[:] = [worker._sink, worker._bound, creating, gate]
                worker._sink, worker._bound = creating, 10.0
            else:
                sink, bound, creating, gate = SWAPPED
                worker._sink, worker._bound = sink, bound
                gate.set()
                creating.close()
            answer = {"ok": True}
        elif "unpins" in cmd:
            answer = {"unpins": unpins[0]}
        elif "stop_copier" in cmd:
            if cmd["stop_copier"] != "none_yet":  # else as a close before any step started one
                worker._start_copier()  # (if none was started yet)
            answer = {"stopped": worker._stop_copier(), "stopping": worker._stopping}
        elif "gate_copies" in cmd:  # copies wait (once begun: their requests started) until the gate opens
            import capture_arena.vllm

            if not hasattr(capture_arena.vllm, "_real_rows"):
                capture_arena.vllm._real_rows = capture_arena.vllm._Rows
            if cmd["gate_copies"]:
                copy_gate.clear()

                class _Gated(capture_arena.vllm._real_rows):
                    def copy(self, *a, **k):
                        copy_gate.wait(60)
                        return super().copy(*a, **k)

                capture_arena.vllm._Rows = _Gated
            else:
                capture_arena.vllm._Rows = capture_arena.vllm._real_rows
                copy_gate.set()
            worker._rows = None  # made again by the next step
            answer = {"ok": True}
        elif "fail_thread_start" in cmd:  # the next n starts of threads of that name fail (no thread to be had)
            name, left = cmd["fail_thread_start"][0], [int(cmd["fail_thread_start"][1])]
            real_start = threading.Thread.start

            def _start(self, real=real_start, name=name, left=left):
                if self.name == name and left[0] > 0:
                    left[0] -= 1
                    raise RuntimeError("can't start new thread (simulated)")
                return real(self)

            threading.Thread.start = _start
            answer = {"ok": True}
        elif "preempt_grace" in cmd:  # how much longer than the bound a preemption waits for a copy under way
            import capture_arena.vllm

            capture_arena.vllm.PREEMPT_GRACE_S = float(cmd["preempt_grace"])
            answer = {"ok": True}
        elif "handle_preemptions" in cmd:  # vLLM's worker hands a step's preempted requests over, before its forward
            t0 = time.monotonic()
            worker.handle_preemptions(pickle.loads(base64.b64decode(cmd["handle_preemptions"])))
            answer = {"s": time.monotonic() - t0}
        elif "stop_in_save" in cmd:  # the next wait_for_save is met by the sink's closing
            stopper = {}

            def _start_copier(real=type(worker)._start_copier, stopper=stopper):
                # Between wait_for_save's look at whether the sink is closing and its hand-over
                # of the step: the close runs now, on a thread of its own, and is given until it
                # is done or 0.5 s (it may have to wait for wait_for_save).
                del worker._start_copier
                running = real(worker)
                t = threading.Thread(target=lambda: stopper.update(stopped=worker._stop_copier()))
                t.start()
                stopper["thread"] = t
                t.join(0.5)
                return running

            worker._start_copier = _start_copier
            save(cmd["stop_in_save"])
            stopper["thread"].join(10)
            answer = {"stopped": stopper.get("stopped"), "stopping": worker._stopping}
        elif "restart_copier" in cmd:
            worker._stopping, worker._copier = False, None
            answer = {"ok": True}
        elif "hold_answers" in cmd:
            (hold.set if cmd["hold_answers"] else hold.clear)()
            answer = {"ok": True}
        elif "queued" in cmd:  # answers waiting unread in the worker's connection (SIOCINQ)
            c = worker._conn
            answer = {"bytes": _queued(c) if c is not None else 0, "conn": c is not None}
        elif "fail_sends" in cmd:
            fail_sends[:] = cmd["fail_sends"]
            answer = {"ok": True}
        elif "finished_sending" in cmd:  # vLLM hands the worker's finished copies to the scheduler
            sched.update_connector_output(ns(finished_sending=set(cmd["finished_sending"])))
            answer = {"ok": True}
        elif "reports_sent" in cmd:
            answer = {"n": reports_sent[0]}
        elif "fail_reports" in cmd:
            fail_reports[0] = int(cmd["fail_reports"])
            answer = {"ok": True}
        elif "shutdown" in cmd:  # vLLM's shutdown of the worker's connector (the process goes on)
            worker.shutdown()
            answer = {"ok": True}
        elif "reconnect" in cmd:  # the next step's results go over a new connection
            worker._drop_conn()
            answer = {"ok": True}
        elif "max_pending" in cmd:  # the scheduler's table of requests, made small (or not)
            import capture_arena.vllm

            capture_arena.vllm.MAX_RESULTS = int(cmd["max_pending"])
            answer = {"ok": True}
        elif "send_timeout" in cmd:  # how long the listener's next connections wait for room in a send
            import capture_arena.vllm

            capture_arena.vllm.ACK_GRACE_S = 4 * float(cmd["send_timeout"])
            answer = {"ok": True}
        elif "peers" in cmd:  # the worker processes the listener has a connection of
            answer = {"peers": sorted(sched._listener._latest)}
        elif "accept_errors" in cmd:
            answer = {"accept_errors": sched._listener.accept_errors, "refused": sched._listener.refused}
        elif "first_line_s" in cmd:  # how long the listener's next connections may send no line
            import capture_arena.vllm

            capture_arena.vllm.FIRST_LINE_S = float(cmd["first_line_s"])
            answer = {"ok": True}
        elif "hold_delivery" in cmd:  # every line the listener reads waits after its read until released
            if cmd["hold_delivery"]:
                delivery_gate.clear()
                held_deliver.append(sched._listener._deliver)

                def _held(*a, real=held_deliver[-1], **k):
                    delayed["read"] += 1
                    delivery_gate.wait(60)  # the instrumented hold (a listener thread held up)
                    try:
                        return real(*a, **k)
                    finally:
                        delayed["done"] += 1

                sched._listener._deliver = _held
            else:
                if held_deliver:
                    sched._listener._deliver = held_deliver[0]
                    held_deliver.clear()
                delivery_gate.set()
            answer = {"ok": True}
        elif "defer" in cmd:  # n made-up keys wait among the listener's frees for worker pid's next connection
            pid, n = int(cmd["defer"][0]), int(cmd["defer"][1])
            sched._listener._deferred.add(pid, [f"vllm/filler-{i:08d}/g1/hidden_states" for i in range(n)])
            answer = {"ok": True}
        elif "stall_idle" in cmd:  # the worker's next answers reader is held up once, after a read timed out
            real_idle, left = worker._free_expired, [1]

            def _stalled(*a, real=real_idle, s=float(cmd["stall_idle"]), left=left):
                if left[0]:
                    left[0] = 0
                    time.sleep(s)  # the instrumented stall (a reader thread held off the GIL)
                    worker._free_expired = real
                return real(*a)

            worker._free_expired = _stalled  # read by the reader of the next connection
            answer = {"ok": True}
        elif "delayed" in cmd:  # lines delivered after such a delay so far
            answer = {"delayed": delayed["done"], "read": delayed["read"]}
        else:
            answer = {"error": f"unknown command {cmd}"}
    except BaseException as e:  # a SimulatedPanic that escaped into vLLM's loop, too
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), file=answers, flush=True)
