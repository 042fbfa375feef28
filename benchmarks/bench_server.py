"""Concurrency of `mlx_dllm serve`: aggregate tok/s and request latency (p50, p90, p99) at 1, 8
and 32 concurrent clients, against serving the same requests one at a time; optionally the same
load on another checkout's server and on `mlx_lm.server` with an autoregressive model, in one run.

    python benchmarks/bench_server.py [--requests 16] [--max-tokens 64] [--block-length 8]
        [--runs 3] [--clients 1,8,32] [--model nemotron|sdar|default] [--turns T]
        [--prompt-cache-size N] [--checkout DIR] [--mlx-lm-model PATH]

--checkout DIR serves the same model with the code of another checkout of this project (e.g. the
commit before the Starlette server: `git worktree add /tmp/old <commit>`), so that two HTTP stacks
are measured by the same clients on the same machine; --mlx-lm-model PATH adds `mlx_lm.server`
serving an autoregressive model (of the same size, for a fair line) to the same requests, less
the diffusion settings. Each server runs alone, one after the other.

The model (--model) is the dense random model of bench_vs_mlx_vlm.py (Nemotron-Labs-Diffusion:
hidden 512, 6 layers, causal-prefix KV cache), a random block-causal SDAR (hidden 384, 6 layers,
vocabulary 4096, the exact prefix cache) or the embedded default (LLaDA, full recompute), served by
`mlx_dllm serve` in a subprocess on 127.0.0.1. With --turns T a request is a conversation: the
client sends T completions, each the previous prompt and answer followed by a new question, so the
server's prompt cache (--prompt-cache-size, 0 turns it off) can reuse the earlier turns' K/V; the
table then adds the mean of usage.prompt_tokens_details.cached_tokens over the later turns. Each measurement sends the same --requests completion requests (distinct
prompts of different lengths, greedy, the family's default sampler) from N client threads, each
sending its next request when its previous one is answered (closed loop): with N = 1 the server
serves them one at a time. Requests that arrive while others decode join the running batch at the
next block boundary. The table quotes medians of --runs runs after a warm-up (the client counts
alternate run by run, so the machine's load hits each alike), latency percentiles over every
measured request, and whether every answer equals the one-at-a-time answer. The machine is shared
and noisy: compare the rows of one table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_vs_mlx_vlm import build_nemotron  # noqa: E402

import mlx_dllm_models_hook  # noqa: E402,F401


def post(url, body, timeout=600):
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(path, port, prompt_cache_size=10, checkout=ROOT):
    """`mlx_dllm serve` with the code of `checkout` (this one by default)."""
    cmd = [sys.executable, "-m", "mlx_dllm_models", "serve", "--model", str(path)]
    cmd += ["--port", str(port), "--log-level", "WARNING"]
    cmd += ["--prompt-cache-size", str(prompt_cache_size)]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    return wait_for(subprocess.Popen(cmd, cwd=str(checkout), env=env), port)


def start_mlx_lm(path, port):
    """`mlx_lm.server` serving an autoregressive model."""
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(port)]
    return wait_for(subprocess.Popen(cmd, cwd=str(ROOT)), port)


def wait_for(proc, port):
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


FOLLOW_UPS = [" And then?", " Why is that?", " Say more about it.", " What else?"]


def converse(url, body, turns):
    """A conversation of `turns` completions, each the previous prompt and answer followed by a
    new question: (its answers joined, completion tokens, cached prompt tokens of turns 2..)."""
    body, answers, tokens, cached = dict(body), [], 0, []
    for turn in range(turns):
        out = post(url, body)
        answer = out["choices"][0]["text"]
        answers.append(answer)
        tokens += out["usage"]["completion_tokens"]
        if turn:
            details = out["usage"].get("prompt_tokens_details") or {}
            cached.append(details.get("cached_tokens", 0))
        body["prompt"] = body["prompt"] + answer + FOLLOW_UPS[turn % len(FOLLOW_UPS)]
    return "|".join(answers), tokens, cached


def load_run(url, bodies, clients, turns=1):
    """Send every body (a conversation of `turns` requests) from `clients` closed-loop threads:
    (wall s, completion tokens, latencies, texts, cached prompt tokens of the later turns)."""
    todo = list(range(len(bodies)))
    lock = threading.Lock()
    latencies, texts, tokens = [None] * len(bodies), [None] * len(bodies), [0] * len(bodies)
    cached, failed = [], []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            tic = time.perf_counter()
            try:
                texts[i], tokens[i], hits = converse(url, bodies[i], turns)
            except OSError as e:  # a refused or reset connection: the request is lost
                failed.append(f"{type(e).__name__}")
                continue
            latencies[i] = time.perf_counter() - tic
            with lock:
                cached.extend(hits)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answered = [x for x in latencies if x is not None]
    return time.perf_counter() - tic, sum(tokens), answered, texts, cached, len(failed)


def build_model(kind, tmp):
    """(checkpoint folder, a line describing it)."""
    if kind == "default":
        from mlx_dllm_models.default import default_checkpoint

        path = default_checkpoint()
        cfg = json.loads((Path(path) / "config.json").read_text())
        return path, f"the embedded default (LLaDA, d_model {cfg['d_model']}, full recompute)"
    if kind == "sdar":
        from fixtures import sdar as fx

        for name, value in dict(VOCAB=4096, HIDDEN=384, HEADS=6, KV_HEADS=2, LAYERS=6).items():
            setattr(fx, name, value)
        path = fx.build_sdar(Path(tmp) / "sdar")
        cfg = json.loads((path / "config.json").read_text())
        return path, (
            f"random SDAR: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            "block-causal prefix cache"
        )
    path, cfg = build_nemotron(Path(tmp) / "nemotron")
    return path, (
        f"nemotron: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        "causal-prefix cache"
    )


def make_bodies(args, path) -> list:
    topics = ["the sea", "a mountain", "rain", "the city at night", "a small cat"]
    bodies = [
        {
            "prompt": f"Request {i}: write about {topics[i % 5]}" + " please" * (i % 4),
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        for i in range(args.requests)
    ]
    if args.model == "default":  # its task: sums, through its chat template
        from transformers import AutoTokenizer

        from mlx_dllm_models.default import addition_prompt, chat_prompt

        tok = AutoTokenizer.from_pretrained(str(path))
        for i, body in enumerate(bodies):
            body["prompt"] = chat_prompt(tok, addition_prompt(10 + 7 * i, 90 - 3 * i))
    else:
        for body in bodies:
            body["block_length"] = args.block_length
    return bodies


def measure(url, bodies, levels, runs, turns) -> dict:
    """Per client count: tok/s of each run, every request's latency, cached tokens, answers."""
    load_run(url, bodies[:2], 1, turns)  # warm-up
    out = {c: {"tps": [], "lat": [], "hits": [], "answers": None, "lost": 0} for c in levels}
    for r in range(runs):
        for c in levels if r % 2 == 0 else reversed(levels):
            wall, toks, latencies, texts, cached, lost = load_run(url, bodies, c, turns)
            row = out[c]
            row["tps"].append(toks / wall)
            row["lat"].extend(latencies)
            row["hits"].extend(cached)
            row["lost"] += lost
            row["answers"] = row["answers"] or texts
            first = out[levels[0]]["answers"] or texts
            differ = [i for i, (a, b) in enumerate(zip(texts, first)) if a != b]
            if differ:
                print(f"  answers that differ from one at a time: requests {differ}")
            print(
                f"run {r} clients {c}: {wall:.2f} s, {toks / wall:.1f} tok/s, "
                f"deterministic {texts == row['answers']}",
                flush=True,
            )
    return out


def table(rows, levels):
    print(
        "| server | clients | aggregate tok/s | vs one at a time | latency p50 s | p90 s | p99 s "
        "| max s | cached prompt tokens (turns 2..) | same answers as one at a time "
        "| requests lost (connection refused or reset) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for label, stats in rows:
        base = statistics.median(stats[levels[0]]["tps"]) or float("nan")
        for c in levels:
            row = stats[c]
            lat = row["lat"]
            q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
            med = statistics.median(row["tps"])
            same = row["answers"] == stats[levels[0]]["answers"]
            print(
                f"| {label} | {c} | {med:.1f} | {med / base:.2f}x | {statistics.median(lat):.2f} "
                f"| {q[89]:.2f} | {q[98]:.2f} | {max(lat):.2f} | "
                f"{statistics.mean(row['hits']) if row['hits'] else 0:.1f} | "
                f"{'yes' if same else 'no'} | {row['lost']} |"
            )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model", choices=["nemotron", "sdar", "default"], default="nemotron")
    ap.add_argument("--turns", type=int, default=1, help="requests per conversation")
    ap.add_argument("--prompt-cache-size", type=int, default=10)
    ap.add_argument("--checkout", type=Path, default=None, help="another checkout to serve too")
    ap.add_argument(
        "--mlx-lm-model",
        default=None,
        help="an AR model for mlx_lm.server too; 'same' serves the benchmark's own Nemotron "
        "checkpoint, an AR model as well, so the two servers run the same weights",
    )
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        path, described = build_model(args.model, tmp)
        bodies = make_bodies(args, path)
        servers = [("this checkout", lambda: start_server(path, args.port, args.prompt_cache_size))]
        if args.checkout is not None:
            servers.append(
                (
                    str(args.checkout),
                    lambda: start_server(path, args.port, args.prompt_cache_size, args.checkout),
                )
            )
        if args.mlx_lm_model is not None:
            ar_model = str(path) if args.mlx_lm_model == "same" else args.mlx_lm_model
            servers.append(
                (f"mlx_lm.server {args.mlx_lm_model}", lambda: start_mlx_lm(ar_model, args.port))
            )
        rows = []
        for label, start in servers:
            print(f"== {label}", flush=True)
            proc, url = start()
            try:
                ar = label.startswith("mlx_lm.server")
                sent = [{k: v for k, v in b.items() if k != "block_length"} for b in bodies]
                rows.append(
                    (label, measure(url, sent if ar else bodies, levels, args.runs, args.turns))
                )
            finally:
                proc.terminate()
                proc.wait(timeout=30)

    print()
    what = f"conversations of {args.turns} requests" if args.turns > 1 else "requests"
    print(
        f"{described}; {args.requests} {what} of {args.max_tokens} tokens; prompt cache "
        f"{args.prompt_cache_size or 'off'}; medians of {args.runs} runs"
    )
    table(rows, levels)


if __name__ == "__main__":
    main()
