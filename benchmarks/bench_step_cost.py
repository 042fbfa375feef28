"""An exact denoising step against the bare model forward it runs (issue #14 section 3).

    python benchmarks/bench_step_cost.py [--prompt 128] [--max-tokens 128] [--block 32] [--runs 5]

For the two exact KV caches, the block-causal prefix cache (a random LLaDA2 MoE: hidden 512, 6
layers, 8 experts) and the causal-prefix cache (a random Nemotron-Labs-Diffusion, hidden 512, 6
layers), both written by the test fixtures' builders (benchmarks/bench_vs_mlx_vlm.py), it decodes
at temperature 0 while a spy on the model times every forward the engine issues. A step is the
time from one denoising forward's call to the next one's: graph building, the forward, the
statistics, the commit rule, the step's host read and the engine's bookkeeping. The bare forward
is that forward alone, `model(block, cache=..., mask=...)` evaluated inside the spy, after the
engine's mask was evaluated (building the mask is the engine's cost, not the forward's).

Reported per family: the median step against the median bare forward, and the mean step over all
denoising steps (which also carries each block's start and end: the block's first host read, the
EOS cut, the first step's folded commit of the finished block) against the mean bare forward.
Medians over --runs decodes after a warm-up. The machine may be shared: the ratio is measured
within one process, call by call.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_vs_mlx_vlm import build_llada2, build_nemotron  # noqa: E402

from mlx_dllm_models import load, stream_generate_diffusion  # noqa: E402

FAMILIES = {
    "llada2 (block-causal prefix cache)": (build_llada2, {"threshold": 0.95}),
    # Nemotron at its trained block size (8); its default sampler commits one token per step.
    "nemotron (causal-prefix cache)": (build_nemotron, {"block_length": 8}),
}


def decode(model, tok, prompt, settings):
    """One decode; per forward: (time of the call, seconds its evaluation took, input columns)."""
    calls = []

    def timed(self, inputs, cache=None, mask=None, head_span=None):
        # The engine builds the mask lazily; its cost belongs to the step, not the forward.
        if isinstance(mask, mx.array):
            mx.eval(mask)
        tic = time.perf_counter()
        out = real(self, inputs, cache=cache, mask=mask, head_span=head_span)
        mx.eval(out, [(c.keys, c.values) for c in cache] if cache is not None else [])
        calls.append((tic, time.perf_counter() - tic, getattr(cache, "start", 0), inputs.shape[1]))
        return out

    cls = type(model)
    real = cls.__call__
    cls.__call__ = timed
    try:
        for last in stream_generate_diffusion(model, tok, prompt, **settings):
            pass
        end = time.perf_counter()
    finally:
        cls.__call__ = real
    # Denoising forwards: from the first one whose columns reach past the prompt.
    first = next(i for i, c in enumerate(calls) if c[2] + c[3] > len(prompt))
    denoise = calls[first:]
    steps = [b[0] - a[0] for a, b in zip(denoise, denoise[1:])] + [end - denoise[-1][0]]
    return steps, [c[1] for c in denoise], last.nfe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    print(
        "| family | denoising forwards | median step ms | median bare forward ms | ratio "
        "| mean step ms | mean bare ms | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (build, extra) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            model, tok = load(tmp)
        prompt = [int(t) % 200 + 10 for t in range(7, 7 + 13 * args.prompt, 13)]
        settings = dict(max_tokens=args.max_tokens, block_length=args.block, temperature=0)
        settings.update(extra)
        decode(model, tok, prompt, settings)  # warm-up
        runs = [decode(model, tok, prompt, settings) for _ in range(args.runs)]
        med_step = statistics.median(statistics.median(s) for s, _, _ in runs)
        med_bare = statistics.median(statistics.median(b) for _, b, _ in runs)
        mean_step = statistics.median(statistics.mean(s) for s, _, _ in runs)
        mean_bare = statistics.median(statistics.mean(b) for _, b, _ in runs)
        print(
            f"| {name} | {len(runs[0][0])} | {med_step * 1e3:.1f} | {med_bare * 1e3:.1f} "
            f"| {med_step / med_bare:.3f} | {mean_step * 1e3:.1f} | {mean_bare * 1e3:.1f} "
            f"| {mean_step / mean_bare:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
