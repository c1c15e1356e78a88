"""A real HTTPS stand-in for the operator's report endpoint, with certificates from test CAs made
by the openssl CLI: it records what a pod's report client sends and gives the answers a test
chooses (a status with its headers, or a connection closed with no answer)."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from accelerate_trainer.contract import REPORT_BODY_KEY

PATH = "/apis/accelerate-operator.io/v1alpha1/namespaces/ml/acceleratejobs/train/status"
DROP = "drop"  # an answer: the connection is closed with no answer (a replica going away)
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    crt, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl("req", "-x509", *_EC, "-keyout", str(key), "-out", str(crt), "-days", "2",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return crt, key


def make_cert(directory: Path, ca: tuple[Path, Path], host: str) -> tuple[Path, Path]:
    """A server certificate for `host` signed by `ca`: (certificate, key)."""
    stem = directory / f"{host}-{ca[0].stem}"
    crt, key, csr, ext = (stem.with_suffix(s) for s in (".crt", ".key", ".csr", ".ext"))
    ext.write_text(f"subjectAltName=DNS:{host}\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={host}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext))
    return crt, key


class ReportEndpoint(ThreadingHTTPServer):
    """Records every POST (path, headers, JSON body); answers from `answers` in turn ((status,
    headers) or (status, headers, fields of the body)), then 200.
    `connections` counts the TLS connections the client opened."""

    daemon_threads = True

    def __init__(self, cert: tuple[Path, Path], answers: list | None = None):
        self.requests: list[tuple[str, dict, dict]] = []
        self.answers = list(answers or [])
        self.connections = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _handler(self))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert[0]), str(cert[1]))
        # The handshake happens in the handler's thread: a client that refuses blocks nothing.
        self.socket = context.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, host: str = "localhost") -> str:
        return f"https://{host}:{self.server_address[1]}{PATH}"

    def next_answer(self) -> tuple[int, dict] | str:
        with self.lock:
            return self.answers.pop(0) if self.answers else (200, {})

    def reports(self) -> list[dict]:
        return [body[REPORT_BODY_KEY] for _, _, body in self.requests]

    def handle_error(self, request, client_address) -> None:
        """A refused handshake is what some tests do: no traceback."""

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _handler(server: ReportEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the operator's aiohttp server

        def setup(self) -> None:
            super().setup()
            with server.lock:
                server.connections += 1

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            server.requests.append((self.path, dict(self.headers), json.loads(body)))
            answer = server.next_answer()
            if answer == DROP:
                self.close_connection = True
                return
            status, headers, *fields = answer
            data = json.dumps({"message": "ok" if status == 200 else f"refused {status}",
                               **(fields[0] if fields else {})})
            self.send_response(status)
            for name, value in {"Content-Type": "application/json",
                                "Content-Length": str(len(data)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, *args) -> None:
            pass

    return Handler
