"""Per-rank memory and generation speed of a tensor-parallel model: run it alone, then under
`mlx.launch`, and compare the two JSON lines.

    python benchmarks/bench_distributed.py [--model PATH] [--runs 5]
    mlx.launch -n 2 --backend ring --python "$(which python)" benchmarks/bench_distributed.py

Without --model it writes (once) a random LLaDA 8B-shaped checkpoint (LLaDAModelLM, OLMo names,
float32; d_model 512, 6 layers, MLP 1408: 77 MB) to --checkpoint. Generation: one prompt,
`max_tokens` 16 in one block of 16, the quota sampler over 4 steps (4 forwards per run), a warm-up
then --runs runs; medians. Rank 0 prints one JSON line with every rank's figures: the weights it
holds, its peak while loading, its peak while generating (MB), and tok/s and ms per forward.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlx_dllm_models import load, stream_generate_diffusion  # noqa: E402
from mlx_dllm_models.distributed import launch_group  # noqa: E402
from mlx_dllm_models.tiny import build_tiny_llada  # noqa: E402

SHAPE = dict(d_model=512, n_layers=6, n_heads=8, mlp_hidden_size=1408)
SETTINGS = dict(max_tokens=16, block_length=16, steps=4, sampler="quota")
PROMPT = list(range(65, 65 + 16))
MB = 1 << 20


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--checkpoint", default="/tmp/mlx_dllm_bench_distributed")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    group = launch_group()
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    path = args.model
    if path is None:
        path = Path(args.checkpoint)
        # Rank 0 writes it; the others wait at the barrier below (same machine or shared disk).
        if rank == 0 and not (path / "model.safetensors").exists():
            build_tiny_llada(path, **SHAPE)
        if group is not None:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))

    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model, tokenizer = load(path, group=group)
    weights = mx.get_active_memory() - before
    load_peak = mx.get_peak_memory() - before

    runs = []
    for i in range(args.runs + 1):
        mx.reset_peak_memory()
        tic = time.perf_counter()
        last = None
        for last in stream_generate_diffusion(model, tokenizer, PROMPT, **SETTINGS):
            pass
        wall = time.perf_counter() - tic
        if i:  # the first run is the warm-up
            runs.append((last.generation_tokens / wall, 1000 * wall / last.nfe))
    gen_peak = mx.get_peak_memory() - before

    mine = mx.array([weights / MB, load_peak / MB, gen_peak / MB])
    every = mine[None] if group is None else mx.distributed.all_gather(mine[None], group=group)
    every = every.reshape(size, 3).tolist()
    if rank == 0:
        print(
            json.dumps(
                {
                    "ranks": size,
                    "weights_mb": [round(r[0], 1) for r in every],
                    "load_peak_mb": [round(r[1], 1) for r in every],
                    "generate_peak_mb": [round(r[2], 1) for r in every],
                    "tok_per_s": round(statistics.median(r[0] for r in runs), 1),
                    "ms_per_forward": round(statistics.median(r[1] for r in runs), 1),
                    "runs": args.runs,
                }
            )
        )


if __name__ == "__main__":
    main()
