"""A gate in front of the GCS emulator: forwards every request, except the writes it is told to fail.

fake-gcs-server has no quotas, no permissions and never hangs; a real bucket has all three. The
gate stands between the clients (tensorstore, gcsfs, google-cloud-storage) and the real emulator
and, while ``refuse`` is set, answers object writes itself: with an error as GCS words it
(``quota``, ``forbidden``), or not at all (``silent``: the connection stays open and mute).
Reads and listings pass (unless ``reads`` is set: then object reads are refused the same way), so the rest of
the run is the emulator's real behaviour.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import urllib.parse

# What GCS answers (status, JSON error body) when a bucket's project is out of quota, or the
# caller may not create objects (the JSON API's error format).
ANSWERS = {
    "quota": (429, {"error": {"code": 429, "message": "The project exceeded its storage quota for this bucket.",
                              "errors": [{"reason": "quotaExceeded", "domain": "usageLimits"}]}}),
    "forbidden": (403, {"error": {"code": 403, "message": "ckptconv-test@example.iam does not have "
                                  "storage.objects.create access to the Google Cloud Storage object.",
                                  "errors": [{"reason": "forbidden", "domain": "global"}]}}),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
              "proxy-authenticate", "host", "content-length"}


def is_write(method: str, path: str) -> bool:
    """Object creation in the JSON API: uploads (simple, multipart, resumable) and compose/copy/rewrite."""
    return method in ("POST", "PUT") and (path.startswith("/upload/") or "/compose" in path or "/rewriteTo/" in path
                                          or "/copyTo/" in path)


def is_read(method: str, path: str) -> bool:
    """An object's bytes read in the JSON API (``alt=media``, or the download endpoint)."""
    return method == "GET" and ("alt=media" in path or path.startswith("/download/"))


class Gate:
    """``url`` to give clients; ``refuse`` is None (pass everything) or a key of ANSWERS or "silent"."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.refuse: str | None = None
        self.only = ""  # refuse only writes of objects whose name holds this, e.g. "/items/"
        self.reads = False  # refuse object reads (downloads) instead of writes
        self.refused = 0
        self._stop = threading.Event()
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                named = urllib.parse.unquote(self.path)  # the object name: in the query, or a multipart body
                refusable = is_read(self.command, self.path) if gate.reads else is_write(self.command, self.path)
                if (gate.refuse and refusable
                        and (gate.only in named or gate.only.encode() in body[:4096])):
                    gate.refused += 1
                    if gate.refuse == "silent":
                        gate._stop.wait()
                        self.close_connection = True
                        return
                    status, answer = ANSWERS[gate.refuse]
                    self._reply(status, {"Content-Type": "application/json"}, json.dumps(answer).encode())
                    return
                upstream = http.client.HTTPConnection(gate.upstream.hostname, gate.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self._reply(response.status, {k: v for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP},
                            data)
                upstream.close()

            def _reply(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` (the emulator's client environment) pointed at the gate instead."""
        return {**base, "STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
