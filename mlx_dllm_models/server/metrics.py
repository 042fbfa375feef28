"""`GET /metrics`: the server's counters in Prometheus' text exposition format (version 0.0.4),
written here (no client library needed): requests by endpoint and status, prompt and completion
tokens, the model's forwards, the requests waiting and running, and forwards by batch size."""

import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "mlx_dllm"


# The endpoints counted by name; any other path is counted as "other" (a client choosing paths
# must not grow the counters without bound).
ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/models", "/health"}
    | {"/metrics", "/v1/images/generations", "/v1/images/edits"}
)


def endpoint(path: str) -> str:
    """The label of a request's path."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in ENDPOINTS else "other"


class Metrics:
    """The counters the HTTP side keeps (the scheduler keeps its own: forwards, batch sizes)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Counter()  # (endpoint, status) -> requests answered
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def answered(self, endpoint: str, status: int, tokens=None) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1
            if tokens is not None:
                self.prompt_tokens += tokens[0]
                self.completion_tokens += tokens[1]

    def exposition(self, scheduler) -> str:
        """The text of a scrape: these counters and the scheduler's."""
        with self.lock:
            requests = sorted(self.requests.items())
            prompt, completion = self.prompt_tokens, self.completion_tokens
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP {PREFIX}_{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            for labels, value in samples:
                inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(
                    f"{PREFIX}_{name}{{{inner}}} {value}" if inner else f"{PREFIX}_{name} {value}"
                )

        metric(
            "requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
            [((("endpoint", e), ("status", str(s))), n) for (e, s), n in requests],
        )
        metric(
            "prompt_tokens_total", "counter", "Prompt tokens of answered requests.", [((), prompt)]
        )
        metric(
            "completion_tokens_total",
            "counter",
            "Completion tokens of answered requests.",
            [((), completion)],
        )
        metric(
            "forwards_total",
            "counter",
            "Model forwards run.",
            [((), scheduler.forwards + scheduler.images.forwards)],
        )
        metric("blocks_total", "counter", "Blocks committed.", [((), scheduler.blocks)])
        waiting, running = queue_depth(scheduler)
        metric("requests_waiting", "gauge", "Requests not yet in a run.", [((), waiting)])
        metric("requests_running", "gauge", "Requests in a decoder run.", [((), running)])
        sizes = sorted(scheduler.batch_rows.items())
        metric(
            "batch_forwards_total",
            "counter",
            "Model forwards by the number of requests (rows) they served.",
            [((("rows", str(rows)),), n) for rows, n in sizes],
        )
        metric(
            "healthy", "gauge", "1 while the server takes requests.", [((), int(scheduler.healthy))]
        )
        return "\n".join(lines) + "\n"


def queue_depth(scheduler):
    """(requests waiting for a run, requests in one), read without the scheduler's lock: a
    scrape's snapshot."""
    waiting, running = scheduler.inbox.qsize(), 0
    for group in list(scheduler.groups.values()):
        if group.run is not None:
            running += sum(not j.done for j in list(group.jobs))
        waiting += len(group.waiting)
    return waiting, running


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
