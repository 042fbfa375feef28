"""A bounded load test of `mlx_dllm serve` (issue #40), on loopback with the embedded default model:
a burst of 64 streaming clients without retries meets no connection error; two requests share one
keep-alive connection; 300 half-sent requests are closed within the header / body timeouts while
a normal request is answered; the chat-template and image attacks get a 400 with the server's
memory growing by less than 200 MB. Every loop is bounded; the test takes seconds."""

import http.client
import json
import socket
import threading
import time

import pytest

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from mlx_dllm_models import load
from mlx_dllm_models.default import default_checkpoint
from mlx_dllm_models.server import make_server, shutdown
from mlx_dllm_models.server.transport import Limits
from server_checks import data_url, grey_png

LIMITS = Limits(header_timeout=1.0, body_timeout=1.0, idle_timeout=5.0)
CHAT = {"messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 8}
HEADERS = {"Content-Type": "application/json"}


def start(load_model, **kwargs):
    server = make_server(load_model, host="127.0.0.1", port=0, model_id="default", **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.fixture(scope="module")
def served():
    server, port = start(
        lambda: load(default_checkpoint()), limits=LIMITS, allow_client_chat_template=True
    )
    yield server, port
    shutdown(server)


def post(port, path, body, timeout=120):
    """(status, body bytes) of one request on a connection of its own."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), HEADERS)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_64_concurrent_streaming_clients_meet_no_connection_error(served):
    server, port = served
    clients = 64
    barrier, results, errors = threading.Barrier(clients), [None] * clients, []

    def client(i):
        barrier.wait(timeout=30)  # all connect at once: a burst
        try:
            body = dict(CHAT, stream=True, steps=2)  # two forwards a row: the burst is the test
            results[i] = post(port, "/v1/chat/completions", body)
        except OSError as e:  # a reset or refused connection: what the old backlog of 5 gave
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    took = time.perf_counter() - started
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    for status, data in results:
        events = [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]"
    print(f"64 streaming clients at once: all answered in {took:.1f} s")


def test_two_requests_share_one_keep_alive_connection(served):
    _, port = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(CHAT), HEADERS)
        first = conn.getresponse()
        assert first.status == 200 and first.version == 11
        first.read()
        sock, local = conn.sock, conn.sock.getsockname()
        conn.request("GET", "/v1/models")
        second = conn.getresponse()
        assert second.status == 200 and json.loads(second.read())["data"]
        # http.client reconnects silently when the server closed: the same socket says it did not.
        assert conn.sock is sock and sock.getsockname() == local
    finally:
        conn.close()


def closed_by(sock, deadline: float) -> float:
    """When the server closed `sock` (its answer, if any, read and dropped); inf if not by
    `deadline`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return float("inf")
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return time.monotonic()
        except socket.timeout:
            return float("inf")
        except OSError:  # reset: closed too
            return time.monotonic()


@pytest.mark.slow
def test_300_half_sent_requests_are_closed_within_the_timeouts(served):
    _, port = served
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    socks = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            # Half never finish their headers; half announce a body that never comes.
            more = (
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" if i % 2 else b""
            )
            sock.sendall(head + more)
            socks.append(sock)
        opened = time.monotonic()
        status, data = post(port, "/v1/chat/completions", CHAT, timeout=60)
        assert status == 200 and json.loads(data)["choices"]  # answered meanwhile
        bound = max(LIMITS.header_timeout, LIMITS.body_timeout) + 2.0
        closed = [closed_by(s, opened + bound + 5) - opened for s in socks]
    finally:
        for sock in socks:
            sock.close()
    assert max(closed) < bound, sorted(closed)[-5:]
    print(f"300 half-sent requests: the last closed after {max(closed):.2f} s")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Peak:
    """The most RSS this process reached while the block ran (sampled every 10 ms)."""

    def __enter__(self):
        self.before = self.most = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.most = max(self.most, rss_bytes())
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.most = max(self.most, rss_bytes())

    @property
    def growth(self) -> int:
        return self.most - self.before


@pytest.fixture(scope="module")
def gemma_port(fixture_dir):
    path = build_once(fixture_dir / "load_gemma", dgfx.CHECKPOINTS["diffusion_gemma"])
    server, port = start(lambda: load(path), limits=LIMITS)
    yield port
    shutdown(server)


def concurrently(calls) -> list:
    out = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


@pytest.mark.slow
def test_template_and_image_attacks_get_a_400_and_little_memory(served, gemma_port):
    _, port = served
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = dict(CHAT, chat_template_kwargs={"chat_template": loops})
    bomb = data_url(grey_png(12000, 12000))  # ~140 KB; 432 MB once decoded to RGB
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": bomb}}]
    image = {"messages": [{"role": "user", "content": content}], "max_tokens": dgfx.CANVAS_LENGTH}
    with Peak() as peak:
        answers = concurrently(
            [lambda: post(port, "/v1/chat/completions", template)] * 5
            + [lambda: post(gemma_port, "/v1/chat/completions", image)] * 3
        )
        # The server still answers, at once, after them.
        assert post(port, "/v1/chat/completions", CHAT)[0] == 200
    for status, data in answers:
        assert status == 400, data
    messages = [json.loads(data)["error"]["message"] for _, data in answers]
    assert all("ran past its budget" in m for m in messages[:5])
    assert all("--max-image-pixels" in m for m in messages[5:])
    print(f"template and image attacks: RSS grew by {peak.growth / 2**20:.0f} MB at most")
    assert peak.growth < 200 * 2**20
