"""A small OpenAI-shaped upstream for the filter's tests (the real backend has its own tests).

It records every request it receives (headers and body) and answers according to request
headers, so a test can make it stream slowly, reset mid-stream, or hang:

  x-mock-mode: normal (default) | stream | reset | hang
  x-mock-chunks: number of SSE chunks (stream/reset), default 5
  x-mock-delay-ms: delay between chunks, default 100

GET /_mock/requests returns what it recorded; POST /_mock/clear forgets it. GET
/v1/admission/leases answers an empty lease report (a gateway's poll, not recorded).
"""

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mock-llm"

    def log_message(self, *args):
        pass

    def _read_body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("content-length", "0"))
        return self.rfile.read(n)

    def _json(self, status, obj, close=False):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/_mock/requests":
            with self.server.lock:
                self._json(200, self.server.recorded)
        elif self.path.startswith("/v1/admission/leases"):
            # A lease report with nothing running: a gateway with the callout sees it up.
            # The connection closes after it: a callout after it needs a new one.
            self._json(200, {"pool": {"capacity_bytes": 1 << 40, "used_bytes": 0}, "admission": "reserve",
                             "leases": [], "finished": [], "cursor": 0}, close=True)
        else:
            with self.server.lock:
                self.server.recorded.append(
                    {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": None}
                )
            self._json(200, {"object": "list", "data": [{"id": "mock", "object": "model"}]})

    def do_POST(self):
        if self.path == "/_mock/clear":
            with self.server.lock:
                self.server.recorded.clear()
            self._json(200, {})
            return
        raw = self._read_body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"_unparsed": raw.decode("latin-1")}
        with self.server.lock:
            self.server.recorded.append(
                {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
            )
        mode = self.headers.get("x-mock-mode", "normal")
        chunks = int(self.headers.get("x-mock-chunks", "5"))
        delay = int(self.headers.get("x-mock-delay-ms", "100")) / 1000
        if mode == "normal":
            self._json(200, {"id": "cmpl-mock", "object": "text_completion",
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
            return
        if mode == "hang":
            time.sleep(float(self.headers.get("x-mock-hang-s", "30")))
            self._json(200, {"choices": []})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(chunks):
            event = f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            except OSError:
                return  # the client went away
            time.sleep(delay)
            if mode == "reset" and i == chunks // 2:
                # Abort the connection with a TCP RST mid-stream.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    # Bursts of 200 concurrent requests: a listen backlog of 5 (the default) drops connections.
    request_queue_size = 512


class MockUpstream:
    def __init__(self, port=0):
        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.server.recorded = []
        self.server.lock = threading.Lock()
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def requests(self):
        with self.server.lock:
            return list(self.server.recorded)

    def clear(self):
        with self.server.lock:
            self.server.recorded.clear()


if __name__ == "__main__":
    import sys

    up = MockUpstream(int(sys.argv[1]) if len(sys.argv) > 1 else 8000).start()
    print(f"mock upstream on 127.0.0.1:{up.port}", flush=True)
    up.thread.join()
