"""What both sides share: the fake model's answer, the OpenAI client on it, a fake model server, the statistics,
and the JSON each side's run hands the driver.

It imports only the standard library and openai/httpx, so that it runs in agl's venv and in Agent Lightning's.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

PROMPT_TOKENS = 600
RESPONSE_TOKENS = 200
MODEL = "bench-model"
WORKLOADS = ("tracer", "rollout_end", "store_calls", "store_http", "dev")

MESSAGES: List[Dict[str, str]] = [{"role": "system", "content": "You are a careful assistant that uses tools."}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "some words " * 20} for i in range(7)
]


def canned_completion() -> bytes:
    """A vLLM-style chat completion: 600 prompt and 200 response token ids, with the response's logprobs."""
    logprobs = [
        {"token": "word", "logprob": -0.25, "bytes": [119, 111, 114, 100], "top_logprobs": []}
    ] * RESPONSE_TOKENS
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "prompt_token_ids": list(range(100_000, 100_000 + PROMPT_TOKENS)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "word " * (RESPONSE_TOKENS // 2)},
                    "finish_reason": "stop",
                    "logprobs": {"content": logprobs},
                    "token_ids": list(range(100_000, 100_000 + RESPONSE_TOKENS)),
                }
            ],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": RESPONSE_TOKENS, "total_tokens": 800},
        }
    ).encode()


def _httpx() -> Any:
    """The httpx the installed openai uses (``httpx2`` for openai >= 3)."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def make_client() -> Any:
    """The real ``openai`` client on an in-process transport that answers at once: no network, no server."""
    import openai

    httpx = _httpx()
    body = canned_completion()
    headers = {"content-type": "application/json"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body, headers=headers))
    return openai.OpenAI(
        base_url="http://bench.invalid/v1", api_key="x", max_retries=0, http_client=httpx.Client(transport=transport)
    )


def call(client: Any, model: str = MODEL) -> Any:
    """One chat completion with the 8 input messages."""
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.7)


def calls(client: Any, n: int) -> None:
    """``n`` calls (workload 1 outside a rollout)."""
    for _ in range(n):
        call(client)


def served_reward(base_url: str, model: str, question: str) -> float:
    """Workload 5's agent body on both sides: one call to the fake model server, 1.0 if it answered."""
    import openai

    reply = openai.OpenAI(base_url=base_url, api_key="x").chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}]
    )
    return 1.0 if reply.choices[0].message.content else 0.0


class FakeModelServer:
    """An OpenAI-compatible server on 127.0.0.1 answering every chat completion with :func:`canned_completion`."""

    def __init__(self) -> None:
        body = canned_completion()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeModelServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A store server in a process of its own (``argv``), ready once its port on 127.0.0.1 accepts connections."""

    def __init__(self, argv: Sequence[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = list(argv), port, log
        self.url = f"http://127.0.0.1:{port}"
        self._process: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> ServerProcess:
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the store server exited at start; its log: {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the store server did not listen within 60 s; its log: {self.log}")

    def __exit__(self, *exc: Any) -> None:
        assert self._process is not None
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def summary(samples: Sequence[float]) -> Dict[str, float]:
    """Median, middle half (quartiles; min and max under 4 samples) and count."""
    values = sorted(samples)
    if not values:
        raise ValueError("summary() needs at least one sample")
    if len(values) >= 4:
        low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    else:
        low, high = values[0], values[-1]
    return {"median": statistics.median(values), "low": low, "high": high, "n": len(values)}


def ratio(agl: Optional[Dict[str, float]], peer: Optional[Dict[str, float]]) -> Optional[float]:
    """agl's median over the peer's; None when a side lacks the figure or the peer's median is 0."""
    if agl is None or peer is None or peer["median"] == 0:
        return None
    return agl["median"] / peer["median"]


# -- what a side's run hands back ---------------------------------------------------------------------------------
class Results:
    """Samples per (measure, variant), and notes; written as JSON for the driver."""

    def __init__(self, side: str, workload: str) -> None:
        self.data: Dict[str, Any] = {"side": side, "workload": workload, "figures": {}, "notes": []}

    def add(self, measure: str, variant: str, samples: Sequence[float]) -> None:
        self.data["figures"].setdefault(measure, {}).setdefault(variant, []).extend(float(s) for s in samples)

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)

    def write(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.data))


def side_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """A side's command line: ``WORKLOAD --out PATH [--quick]``."""
    parser = argparse.ArgumentParser(description="one side's run of one workload (run.py drives it)")
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke run")
    return parser.parse_args(argv)


def fail(message: str) -> None:
    """A one-line error and exit 2 (bad input or a broken environment, not a traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
