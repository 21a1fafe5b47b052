"""A live-capture intake that speaks SpecForge's protocol, for the tests: our own code following
the logic of SpecForge's ``specforge/runtime/data_plane/intake_server.py`` (``CaptureIntakeServer``)
and of the trainer side it feeds (``specforge/inference/adapters/live_intake.py``,
``LiveIntakeRefSource.ref_from_record``), neither of which is in the ``specforge`` package on the
registry (0.2.0).

The protocol, as upstream has it:

- ``GET /v1/spec-capture/config``: 200 with the config (``store_id``, ``run_id``, ``gen``,
  ``features``, ``passthrough`` with sources, ``min_num_tokens``, ``max_num_tokens``);
- ``POST /v1/spec-capture/records``: a JSON object of 1 byte to 1 MiB (else 400), with a
  non-empty string ``sample_id`` (else 400); ``origin`` defaults to the client's address; a
  ``sample_id`` accepted before is answered 200 ``{"status": "duplicate"}`` without being
  handed on (a FIFO of the last 65536 accepted ids; shed and rejected ids are not remembered);
  otherwise ``on_record(record)`` decides: ``accepted`` 200, ``shed`` 429, ``rejected`` 422, an
  exception 500; any other path 404.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

CONFIG_PATH = "/v1/spec-capture/config"
RECORDS_PATH = "/v1/spec-capture/records"
MAX_RECORD_BYTES = 1 << 20
STATUS = {"accepted": 200, "shed": 429, "rejected": 422}

OnRecord = Callable[[dict[str, Any]], tuple[str, str]]


class _Served:
    """A test HTTP server on 127.0.0.1 (``_server``): its URL, and stopping it."""

    _server: ThreadingHTTPServer
    _scheme = "http"

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Intake(_Served):
    """The intake server on 127.0.0.1 (see the module docs), on ``port`` if given (an intake
    started again where a stopped one was). ``on_record`` may be replaced while it runs."""

    def __init__(
        self, config: Mapping[str, Any], on_record: OnRecord, dedup_capacity: int = 65536, port: int = 0, tls: Optional[tuple[str, str]] = None
    ) -> None:
        """``tls`` (a certificate file and its key file): the intake speaks https."""
        self.config = dict(config)
        self.on_record = on_record
        self.counts = collections.Counter[str]()
        #: Accepted records whose answer is lost (the connection closed instead), from now.
        self.lose_answers = 0
        self._accepted: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._capacity = dedup_capacity
        self._lock = threading.Lock()
        intake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _answer(self, status: int, body: Mapping[str, Any]) -> None:
                data = json.dumps(body, separators=(",", ":")).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                    self.close_connection = True

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != CONFIG_PATH:
                    return self._answer(404, {"error": "unknown path"})
                intake.counts["config"] += 1
                self._answer(200, intake.config)

            def do_POST(self) -> None:
                if self.path.split("?", 1)[0] != RECORDS_PATH:
                    return self._answer(404, {"error": "unknown path"})
                length = int(self.headers.get("Content-Length") or "0")
                if length < 1 or length > MAX_RECORD_BYTES:
                    return self._answer(400, {"error": "invalid body size"})
                try:
                    record = json.loads(self.rfile.read(length))
                    if not isinstance(record, dict):
                        raise ValueError("record must be a JSON object")
                except ValueError as e:
                    return self._answer(400, {"error": str(e)})
                record.setdefault("origin", self.client_address[0])
                sid = record.get("sample_id")
                if not isinstance(sid, str) or not sid:
                    return self._answer(400, {"error": "record requires a sample_id"})
                status, code, body = intake._dispatch(sid, record)
                with intake._lock:
                    lose = status == "accepted" and intake.lose_answers > 0
                    intake.lose_answers -= lose
                if lose:  # accepted, but the answer never reaches the client
                    self.close_connection = True
                    return
                self._answer(code, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        if tls is not None:  # each accepted connection's handshake runs on its handler's thread
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
            self._scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-intake", daemon=True)
        self._thread.start()

    def _dispatch(self, sid: str, record: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
        with self._lock:
            if sid in self._accepted:
                self.counts["duplicate"] += 1
                return "duplicate", 200, {"status": "duplicate"}
            try:
                status, detail = self.on_record(record)
                code = STATUS[status]
            except Exception as e:
                self.counts["error"] += 1
                return "error", 500, {"error": f"{type(e).__name__}: {e}"}
            self.counts[status] += 1
            if status == "accepted":
                self._accepted[sid] = None
                while len(self._accepted) > self._capacity:
                    self._accepted.popitem(last=False)
            return status, code, {"status": status, "detail": detail}



def config_payload(store_id: str, *, run_id: str = "run", max_num_tokens: int = 4096) -> dict[str, Any]:
    """The config SpecForge's ``LiveIntakeRefSource.config_payload`` serves for a DSpark-like
    schema: aux and last hidden state, input_ids from the tokens, loss_mask all ones."""
    return {
        "store_id": store_id,
        "run_id": run_id,
        "gen": 1,
        "features": {"aux": "hidden_states", "last_hidden": "target_last_hidden_states"},
        "passthrough": [{"name": "input_ids", "source": "tokens"}, {"name": "loss_mask", "source": "ones"}],
        "min_num_tokens": 2,
        "max_num_tokens": max_num_tokens,
    }


def ref_from_record(record: Mapping[str, Any], *, store_id: str, aux_width: int, run_id: str = "run", max_num_tokens: int = 4096) -> Any:
    """A trainer's ref for a live record, following ``LiveIntakeRefSource.ref_from_record``:
    the record must be of this store, gen 1, 2..max_num_tokens tokens, with the schema's
    features whose sequence length is ``num_tokens`` and an aux width of ``aux_width``; raises
    ValueError otherwise (the intake answers 422)."""
    from specforge.runtime.contracts import FeatureSpec, SampleRef

    if record.get("store_id") != store_id:
        raise ValueError(f"record store_id {record.get('store_id')!r} is not the run store {store_id!r}")
    if record.get("gen") != 1:
        raise ValueError("live records have gen 1")
    n = record.get("num_tokens")
    if not isinstance(n, int) or not 2 <= n <= max_num_tokens:
        raise ValueError(f"num_tokens {n!r} out of range")
    feats = record.get("features")
    expected = {"hidden_states", "target_last_hidden_states", "input_ids", "loss_mask"}
    if not isinstance(feats, Mapping) or set(feats) != expected:
        raise ValueError(f"features {sorted(feats or {})} are not the schema's {sorted(expected)}")
    for name, f in feats.items():
        if int(f["shape"][1]) != n:
            raise ValueError(f"{name}: seq len {f['shape'][1]} is not num_tokens {n}")
    if int(feats["hidden_states"]["shape"][2]) != aux_width:
        raise ValueError(f"aux width {feats['hidden_states']['shape'][2]} is not {aux_width}")
    sid = str(record["sample_id"])
    return SampleRef(
        sample_id=sid,
        run_id=run_id,
        source_task_id=sid,
        feature_store_uri=f"mooncake://{store_id}/{sid}",
        feature_keys={name: f"{sid}/{name}" for name in feats},
        feature_specs={name: FeatureSpec(name=name, shape=tuple(f["shape"]), dtype=f["dtype"]) for name, f in feats.items()},
        strategy="dspark",
        num_tokens=n,
        metadata={"transport": "sglang_live_capture", "server": str(record.get("origin", "live")), "generation": 1},
    )


class Producer:
    """The trainer-side producer a live intake feeds, following SpecForge's live producer
    (``build_disagg_live_producer``'s ``on_record``): the record becomes a ref
    (``ref_source.ref_from_record``, rejected if it raises), the store adopts it, and it goes
    to the channel (here a list the test consumes). ``mode`` forces ``shed`` (its in-flight
    watermark) or ``rejected``; ``gate``, when set, holds every record until it is opened."""

    def __init__(self, store: Any, ref_source: Any) -> None:
        self.store = store
        self.ref_source = ref_source
        self.refs: list[Any] = []
        self.mode: Optional[str] = None
        self.gate: Optional[threading.Event] = None
        self.seen = threading.Condition()
        self.received = 0

    def on_record(self, record: dict[str, Any]) -> tuple[str, str]:
        gate = self.gate
        with self.seen:
            self.received += 1
            self.seen.notify_all()
        if gate is not None:
            gate.wait(60)
        if self.mode is not None:
            return self.mode, f"forced {self.mode}"
        try:
            ref = self.ref_source.ref_from_record(record)
        except ValueError as e:
            return "rejected", str(e)
        self.store.adopt(ref)
        self.refs.append(ref)
        return "accepted", "ok"


class ForwardProxy(_Served):
    """An HTTP forward proxy on 127.0.0.1 (what ``http_proxy`` names): takes requests for
    absolute URLs, forwards them, and counts them by method and path (``seen``); answers 502
    when the upstream refuses the connection or closes it without an answer, as nginx and squid
    do. A ``CONNECT host:port`` (https through the proxy) is answered 200 and tunnelled: bytes
    go both ways until either side closes (counted as ``CONNECT host:port``)."""

    def __init__(self, credentials: Optional[str] = None) -> None:
        """``credentials`` (``user:password``): the proxy answers 407 to a request without them
        in its ``Proxy-Authorization`` header (Basic), counted as ``refused``."""
        import base64
        import http.client
        import urllib.parse

        self.seen = collections.Counter[str]()
        proxy = self
        wanted = None if credentials is None else "Basic " + base64.b64encode(credentials.encode()).decode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _refused(self) -> bool:
                if wanted is None or self.headers.get("Proxy-Authorization") == wanted:
                    return False
                proxy.seen["refused"] += 1
                self.send_response(407)
                self.send_header("Proxy-Authenticate", 'Basic realm="test"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def do_CONNECT(self) -> None:
                if self._refused():
                    return
                proxy.seen[f"CONNECT {self.path}"] += 1
                host, port = self.path.rsplit(":", 1)
                try:
                    upstream = socket.create_connection((host, int(port)), timeout=30)
                except OSError as e:
                    self.send_error(502, f"Bad Gateway: {e}")
                    return
                self.send_response(200, "Connection established")
                self.end_headers()
                self.wfile.flush()
                self.close_connection = True

                def pipe(src: socket.socket, dst: socket.socket) -> None:
                    try:
                        while data := src.recv(65536):
                            dst.sendall(data)
                    except OSError:
                        pass
                    finally:
                        for sock in (src, dst):
                            try:
                                sock.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass

                back = threading.Thread(target=pipe, args=(upstream, self.connection), daemon=True)
                back.start()
                pipe(self.connection, upstream)
                back.join(30)
                upstream.close()

            def _forward(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if self._refused():
                    return
                proxy.seen[f"{self.command} {url.path}"] += 1
                length = int(self.headers.get("Content-Length") or "0")
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=30)
                try:
                    conn.request(self.command, url.path, body=body, headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                    resp = conn.getresponse()
                    status, data = resp.status, resp.read()
                except ConnectionRefusedError as e:  # as nginx and squid answer when the upstream is down
                    status, data = 502, f"Bad Gateway: {e}".encode()
                except (http.client.RemoteDisconnected, ConnectionResetError) as e:
                    # nginx: "upstream prematurely closed connection while reading response
                    # header", answered 502 (the upstream may have taken the request).
                    status, data = 502, f"Bad Gateway: {e}".encode()
                finally:
                    conn.close()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _forward
            do_POST = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="test-proxy", daemon=True).start()


def stalling_server(pattern: str) -> tuple[int, threading.Event]:
    """A server on loopback (an intake, a capture server) that reads a request and never
    finishes its answer: it sends ``"100 Continue"`` answers, or its headers, or its body, a
    piece every 0.2 s until the client goes away (or the event is set)."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    pieces = {
        "continue": [b"HTTP/1.1 100 Continue\r\n\r\n"],
        "headers": [bytes([c]) for c in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 100000],
        "body": [b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"] + [b'{"status": "accepted"} '] * 10000,
    }[pattern]

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                for i in range(10**6):
                    if stop.is_set():
                        return
                    try:
                        conn.sendall(pieces[i % len(pieces)])
                    except OSError:
                        return  # the client went away
                    time.sleep(0.2)

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], stop

def call_within(call: Callable[[], Any], wait_s: float, then: Optional[threading.Event] = None) -> tuple[Any, float]:
    """Runs ``call`` on a thread of its own, waiting at most ``wait_s`` for it (``then`` is set
    after, to stop a server it talks to); what it returned or raised, and how long it took.
    Fails the test when it still runs."""
    outcome: list[Any] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            outcome.append(call())
        except Exception as e:
            outcome.append(e)
        outcome.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)
    if then is not None:
        then.set()
    assert not t.is_alive(), f"still waiting after {wait_s} s"
    return outcome[0], outcome[1]
