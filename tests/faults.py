"""Real failures for the shard reader: a loopback HTTP proxy in front of the moto S3 server that
answers 5xx, stalls, or cuts a response body in the middle, on request; and a second moto server
(in its own process) that checks credentials."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}

_ERRORS = {
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
    b"<Message>We encountered an internal error. Please try again.</Message></Error>",
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
    b"<Message>Service is unable to handle request.</Message></Error>",
}


class FaultProxy:
    """Forwards every request to ``upstream`` (host, port) unless a planned fault applies.

    ``fail(kind, value, times, method, path)`` plans faults for the next matching requests
    (``method=None``: any method; ``path``: only requests whose path contains it):
    ``("status", 503)`` answers with that S3 error; ``("cut", 0.5)`` sends the headers and the
    given fraction of the body, then drops the connection; ``("stall", 2.0)`` waits that many
    seconds before answering; ``("lost", 0)`` forwards the request and drops the connection
    without answering (a write the store took whose answer was lost); ``("hold", 0)`` waits until
    ``release()`` (a destination that
    hangs for as long as a test needs, without a clock). ``log`` records ``(method, path, range
    header, fault)``.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.plan: deque[tuple[str | None, str, float, str | None]] = deque()
        self.log: list[tuple[str, str, str | None, str | None]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.released = threading.Event()
        self.holding = threading.Event()  # set while a request is held
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.daemon = True
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(
        self, kind: str, value: float, times: int = 1, method: str | None = "GET", path: str | None = None
    ) -> None:
        with self.lock:
            for _ in range(times):
                self.plan.append((method, kind, value, path))

    def release(self) -> None:
        """Let every held request (and every later one planned to hold) through."""
        self.released.set()

    def stop(self) -> None:
        self.stopped.set()
        self.released.set()
        self.server.shutdown()
        self.server.server_close()

    def _take(self, method: str, path: str) -> tuple[str, float] | None:
        with self.lock:
            for i, (m, kind, value, where) in enumerate(self.plan):
                if (m is None or m == method) and (where is None or where in path):
                    del self.plan[i]
                    return kind, value
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        fault = self._take(h.command, h.path)
        with self.lock:
            self.log.append((h.command, h.path, h.headers.get("Range"), fault and fault[0]))
        if fault is not None and fault[0] == "status":
            status = int(fault[1])
            data = _ERRORS[status]
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        if fault is not None and fault[0] == "stall":
            self.stopped.wait(fault[1])
        if fault is not None and fault[0] == "hold":
            self.holding.set()
            self.released.wait()
        if self.stopped.is_set():
            h.close_connection = True
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except OSError:  # the upstream server was stopped on purpose
            h.close_connection = True
            return
        finally:
            conn.close()
        if fault is not None and fault[0] == "lost":
            # the upstream did it, the client never hears: a write stored whose answer was lost
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and (k.lower() != "content-length" or h.command == "HEAD"):
                h.send_header(k, v)
        if h.command != "HEAD":
            h.send_header("Content-Length", str(len(data)))
        if fault is not None and fault[0] == "cut":
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(data[: int(len(data) * fault[1])])
            h.wfile.flush()
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.end_headers()
        if h.command != "HEAD":
            try:
                h.wfile.write(data)
            except OSError:  # the client gave up on a stalled answer
                h.close_connection = True


def kill_after_checkpoints(script: str, args: list[str], count: int, *, past: float = 0.0) -> list[int]:
    """Run the training ``script`` (the repository on PYTHONPATH) until it has printed
    ``checkpoint N`` ``count`` times (or two minutes passed), wait ``past`` seconds more, and SIGKILL
    it. Returns the checkpoint numbers it printed; asserts it died of the SIGKILL."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, text=True, env=env)
    checkpoints: list[int] = []
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("checkpoint"):
            checkpoints.append(int(line.split()[1]))
        if len(checkpoints) >= count or time.monotonic() > deadline:
            break
    time.sleep(past)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return checkpoints


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class AuthS3:
    """A moto S3 server in its own process that rejects unknown credentials (IAM auth on)."""

    def __init__(self) -> None:
        self.port = free_port()
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0")
        moto_server = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc = subprocess.Popen(
            [moto_server, "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the moto server with authentication did not start") from None
                time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
