"""One rank of tests/test_distributed.py, launched by `mlx.launch` (or with a single process for
the baseline): for each checkpoint of the plan, load it (sharded over the launch's group when
there is one), record the logits of one forward, the tokens of a greedy generation and the memory
the load took, and write them to OUT/rank<r>.npz; then run `mlx_dllm generate` with the plan's
`cli` arguments, each rank's standard output in OUT/cli_rank<r>.txt; then `mlx_dllm serve` with
the plan's `serve` entry (launched over several ranks only): rank 0 also runs a client thread that
waits for the server, sends the plan's requests concurrently, writes the answers' texts to
OUT/serve_answers.json and stops the server with SIGTERM; each rank's exit in
OUT/serve_rank<r>.code.

    python tests/distributed_worker.py PLAN.json OUT
"""

import gc
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.cli import main
from mlx_dllm_models.distributed import launch_group, share


def run(plan: dict, out: Path) -> None:
    group = launch_group()
    rank = 0 if group is None else group.rank()
    results = {}
    for name, entry in plan["checkpoints"].items():
        # The previous checkpoint's arrays must be gone before `before` is read: freed during
        # this load they would make its weights look smaller (a model is freed by the garbage
        # collector, its logits when the name is rebound).
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        model, tokenizer = load(entry["path"], group=group)
        mx.eval(model.parameters())
        results[f"{name}/load_peak"] = np.array(mx.get_peak_memory() - before)
        results[f"{name}/weights"] = np.array(mx.get_active_memory() - before)
        if entry.get("memory_only"):
            del model, tokenizer
            continue
        ids = mx.array([entry["prompt"]])
        logits = model(ids)
        results[f"{name}/logits"] = np.array(logits.astype(mx.float32))
        r = batch_generate_diffusion(model, tokenizer, [entry["prompt"]], **entry["settings"])
        results[f"{name}/tokens"] = np.array(r.tokens[0], dtype=np.int64)
        del model, tokenizer, logits, r
    # What a server does with a request: rank 0's object on every rank.
    results["share/from_rank"] = np.array(share({"from_rank": rank}, group)["from_rank"])
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank}.npz", **results)
    if "cli" in plan:
        # `mlx_dllm generate` on every rank: what each rank printed goes to its own file.
        stdout = sys.stdout
        with open(out / f"cli_rank{rank}.txt", "w") as f:
            sys.stdout = f
            try:
                code = main(plan["cli"])
            finally:
                sys.stdout = stdout
        (out / f"cli_rank{rank}.code").write_text(str(code))
    if "serve" in plan and group is not None:  # alone, the tests serve in process
        entry = plan["serve"]
        if rank == 0:
            args = (entry["port"], entry["requests"], out)
            threading.Thread(target=_clients, args=args, daemon=True).start()
        argv = ["serve", "--model", entry["model"], "--port", str(entry["port"])]
        try:
            code = str(main(argv + ["--log-level", "ERROR"]))
        except SystemExit as e:
            code = str(e)
        (out / f"serve_rank{rank}.code").write_text(code)


def _ask(url: str, request: dict) -> str:
    """The text of one completion (the concatenated chunks of a streamed one; only the first
    chunk's when the request says `disconnect`: the client then hangs up)."""
    body = json.dumps(request["body"]).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + request["path"], data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        if request.get("disconnect"):
            for line in r:
                if line.startswith(b"data: {"):
                    return json.loads(line[len("data: ") :])["choices"][0]["text"] or ""
            raise AssertionError("the stream ended before its first chunk")
        if not request["body"].get("stream"):
            choice = json.loads(r.read())["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        text = ""
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: ") :])["choices"][0]
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                text += piece or ""
        return text


def _clients(port: int, requests: dict, out: Path) -> None:
    url = f"http://127.0.0.1:{port}"
    answers = {}
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

        def ask(name, request):
            try:
                answers[name] = _ask(url, request)
            except Exception as e:
                answers[name] = f"failed: {e!r}"

        threads = [threading.Thread(target=ask, args=item) for item in requests.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    except Exception as e:
        answers["error"] = repr(e)
    finally:
        (out / "serve_answers.json").write_text(json.dumps(answers))
        os.kill(os.getpid(), signal.SIGTERM)  # as a user stops the server (rank 0 only)


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
