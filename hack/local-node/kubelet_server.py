"""The small slice of the kubelet HTTPS API that the local node agent serves, per node.

Only what `kubectl logs [-f]` needs through the API server: `GET /containerLogs/{ns}/{pod}/{c}`
(follow, tailLines, limitBytes, previous, sinceSeconds ignored, timestamps best effort) and
`/healthz`. The API server authenticates with its kubelet client certificate and does not verify
our self-signed serving certificate (it has no --kubelet-certificate-authority); we do not
authorise requests: the port is bound to 127.0.0.1 only and pods cannot reach it.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

log = logging.getLogger("kubelet-api")

# find_log(ns, pod, container, previous) -> (path or None, is_running() -> bool)
LogFinder = Callable[[str, str, str, bool], "tuple[str | None, Callable[[], bool]]"]


def _tail(path: str, lines: int) -> int:
    """Offset of the start of the last `lines` lines of the file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        found = 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            if pos + step == end and chunk.endswith(b"\n"):
                chunk = chunk[:-1]  # the final newline does not start a line
            for i in range(len(chunk) - 1, -1, -1):
                if chunk[i] == 0x0A:
                    found += 1
                    if found == lines:
                        return pos + i + 1
        return 0


def make_handler(find_log: LogFinder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # close-delimited bodies: simplest for follow streams

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug(fmt, *args)

        def _text(self, code: int, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlparse(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            if parts in (["healthz"], ["livez"], ["readyz"]):
                return self._text(200, "ok")
            if len(parts) != 4 or parts[0] != "containerLogs":
                return self._text(404, f"the local node agent does not serve {url.path}")
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            _, ns, pod, container = parts
            previous = q.get("previous") == "true"
            path, running = find_log(ns, pod, container, previous)
            if path is None or not os.path.exists(path):
                return self._text(404, f"no logs for container {container!r} of pod {ns}/{pod}"
                                       f"{' (previous)' if previous else ''}")
            self._stream(path, running, q)

        def _stream(self, path: str, running: Callable[[], bool], q: dict) -> None:
            follow = q.get("follow") == "true" and not q.get("previous") == "true"
            limit = int(q["limitBytes"]) if q.get("limitBytes") else None
            stamps = q.get("timestamps") == "true"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.end_headers()
            sent = 0
            with open(path, "rb") as f:
                if q.get("tailLines"):
                    f.seek(_tail(path, int(q["tailLines"])))
                pending = b""
                while True:
                    chunk = f.read(65536)
                    if not chunk:
                        if not follow or not running():
                            # A last read: the process may have written just before exiting.
                            chunk = f.read()
                            if not chunk:
                                break
                        else:
                            time.sleep(0.2)
                            continue
                    if stamps:  # best effort: the time we read the line, not when it was written
                        pending += chunk
                        lines = pending.split(b"\n")
                        pending = lines.pop()
                        ts = datetime.datetime.now(datetime.timezone.utc).strftime(
                            "%Y-%m-%dT%H:%M:%S.%fZ").encode()
                        chunk = b"".join(ts + b" " + line + b"\n" for line in lines)
                    if limit is not None:
                        chunk = chunk[: max(0, limit - sent)]
                    try:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                        return
                    sent += len(chunk)
                    if limit is not None and sent >= limit:
                        return
                if pending:
                    self.wfile.write(pending)

    return Handler


def serve_kubelet_api(port: int, cert: str, key: str, find_log: LogFinder) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(find_log))
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name=f"kubelet-api-{port}", daemon=True).start()
    return server
