"""Decoding speed of a checkpoint under several settings: NFE, tokens per forward, tok/s, peak memory.

    python benchmarks/bench_generate.py --model PATH [--prompt TEXT] [--runs 5] \
        [--config 'sampler=quota,steps=32' --config 'sampler=threshold,threshold=0.9' ...]

Each configuration runs once as a warm-up, then --runs times; the table quotes medians. Without a
--model it uses the embedded default. The machine is shared and noisy: compare rows of one run,
never absolute numbers across runs or machines.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_CONFIGS = [
    "sampler=quota",
    "sampler=threshold,threshold=0.9",
    "sampler=factor,factor=1.0",
    "sampler=entropy,entropy_bound=0.1",
]


def parse_config(text):
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def run_once(model, tokenizer, prompt, settings):
    from mlx_dllm_models import stream_generate_diffusion

    tic = time.perf_counter()
    last = None
    for last in stream_generate_diffusion(model, tokenizer, prompt, **settings):
        pass
    wall = time.perf_counter() - tic
    return {
        "nfe": last.nfe,
        "tokens": last.generation_tokens,
        "tpf": last.tokens_per_forward,
        "tps": last.generation_tokens / wall,
        "ms_per_forward": 1000 * wall / max(last.nfe, 1),
        "peak_gb": last.peak_memory,
    }


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="Explain why the sky is blue in two sentences.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--config", action="append", default=None, help="comma-separated settings, repeatable"
    )
    args = ap.parse_args()

    from mlx_dllm_models import load
    from mlx_dllm_models.default import default_checkpoint

    path = args.model or default_checkpoint()
    model, tokenizer = load(path)
    prompt = args.prompt
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    print(
        f"model: {path}  ({model.diffusion_spec.family}), max_tokens={args.max_tokens}, "
        f"runs={args.runs} (median after 1 warm-up)"
    )
    header = f"{'settings':44s} {'NFE':>5s} {'tokens':>6s} {'tok/fwd':>7s} {'tok/s':>8s} {'ms/fwd':>7s} {'peak GB':>8s}"
    print(header)
    print("-" * len(header))
    for cfg in args.config or DEFAULT_CONFIGS:
        settings = {"max_tokens": args.max_tokens, **parse_config(cfg)}
        run_once(model, tokenizer, prompt, settings)
        runs = [run_once(model, tokenizer, prompt, settings) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{cfg:44s} {med['nfe']:5.0f} {med['tokens']:6.0f} {med['tpf']:7.2f} {med['tps']:8.1f} "
            f"{med['ms_per_forward']:7.2f} {med['peak_gb']:8.3f}"
        )


if __name__ == "__main__":
    main()
