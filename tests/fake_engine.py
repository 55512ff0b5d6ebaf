"""A stand-in for an engine's OpenAI server (vLLM's api_server module, SGLang's launch_server,
trtllm-serve): it records how it was started (its argv as the process sees it, the command line `ps`
shows, the environment's key variables) into $FAKE_ENGINE_RECORD, optionally changes a file first
($FAKE_ENGINE_TAMPER: a change between specpack's verify and the engine's load; $FAKE_ENGINE_SWAP: a file
changed while the engine loads it and put back), answers /health on
its --host/--port for $FAKE_ENGINE_SERVE_S seconds and exits 0; on SIGTERM it records that it was
stopped."""

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _record(extra: dict | None = None) -> None:
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = [a.decode() for a in f.read().split(b"\0") if a]
    data = {"argv": sys.argv, "cmdline": cmdline, "env": {k: v for k, v in os.environ.items() if "API_KEY" in k},
            **(extra or {})}
    with open(os.environ["FAKE_ENGINE_RECORD"], "w") as f:
        json.dump(data, f)


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    _record()
    if os.environ.get("FAKE_ENGINE_TAMPER"):
        with open(os.environ["FAKE_ENGINE_TAMPER"], "ab") as f:
            f.write(b" ")
    if os.environ.get("FAKE_ENGINE_SWAP"):  # another user's swap: changed while "loaded", then put back
        path = os.environ["FAKE_ENGINE_SWAP"]
        with open(path, "rb") as f:
            original = f.read()
        with open(path, "wb") as f:
            f.write(original + b" swapped")
        _record({"loaded_swapped": True})
        with open(path, "wb") as f:
            f.write(original)

    def stopped(signum, frame):
        _record({"stopped": "SIGTERM"})
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    argv = sys.argv
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    server = ThreadingHTTPServer((host, port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(float(os.environ.get("FAKE_ENGINE_SERVE_S", "3")))
    server.shutdown()


if __name__ == "__main__":
    main()
