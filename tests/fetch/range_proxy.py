"""A proxy in front of a local hub server that answers HTTP range requests for file downloads.

olah (``olah_server``) serves the hub's API, but answers a ranged download with the whole file; the
hub and its CDN answer with 206 and the range. This proxy passes every request through and cuts a
``resolve`` download to the range asked for, recording each range it served, so a test sees exactly
which bytes left the "hub".
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_HOP_HEADERS = {"transfer-encoding", "connection", "content-length", "keep-alive"}


@dataclass
class Served:
    """What the proxy sent for downloads: (path, start, end exclusive) per ranged answer, and the
    paths answered whole."""

    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    whole: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bytes_of(self, name: str) -> int:
        with self.lock:
            return sum(end - start for path, start, end in self.ranges if path.endswith("/" + name))


@contextlib.contextmanager
def range_proxy(upstream: str) -> Iterator[tuple[str, Served]]:
    """Serve on 127.0.0.1 in a thread; yields the proxy's endpoint and its record of downloads."""
    netloc = urlsplit(upstream).netloc
    served = Served()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not traffic
            pass

        def _forward(self) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "range")}
            conn = http.client.HTTPConnection(netloc, timeout=30)
            length = int(self.headers.get("content-length") or 0)
            conn.request(self.command, self.path, body=self.rfile.read(length) if length else None, headers=headers)
            answer = conn.getresponse()
            body = answer.read()
            conn.close()
            status, out_headers = (
                answer.status,
                [(k, v) for k, v in answer.getheaders() if k.lower() not in _HOP_HEADERS],
            )
            wanted = _RANGE.fullmatch(self.headers.get("range", "").strip())
            if "/resolve/" in self.path and status == 200 and self.command == "GET":
                if wanted:
                    start = int(wanted.group(1))
                    end = min(len(body), int(wanted.group(2)) + 1 if wanted.group(2) else len(body))
                    with served.lock:
                        served.ranges.append((self.path, start, end))
                    out_headers.append(("Content-Range", f"bytes {start}-{end - 1}/{len(body)}"))
                    status, body = 206, body[start:end]
                else:
                    with served.lock:
                        served.whole.append(self.path)
            self.send_response(status)
            for key, value in out_headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="range-proxy")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
