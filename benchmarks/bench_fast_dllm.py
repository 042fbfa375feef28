"""Fast-dLLM's approximate caches (cache="prefix" / "dual") against full recompute (cache="none"),
for the quota, threshold and factor samplers, on the embedded default model with a long few-shot
prompt.

    python benchmarks/bench_fast_dllm.py [--shots 12] [--problems 4] [--runs 3] [--block 32]

The prompt is the default task's question after `--shots` solved examples ("What is 47+85? 132"
lines, about 19 tokens each: 12 shots make a prompt of about 260 tokens). Each setting runs once
as a warm-up, then --runs times over the same --problems held-out questions; the table quotes the
median wall time of a run, forwards and tokens per forward (summed over the problems), peak memory
and the fraction of answers that are right. The default model was trained on single questions
only (issue #14 section 2 would extend it to few-shot prompts), so its accuracy here says little
about what a cache costs; forwards, tokens per forward and time are what this measures. The
machine may be shared: compare rows of one run, never absolute numbers across machines.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dllm_models import load, stream_generate_diffusion  # noqa: E402
from mlx_dllm_models.default import (  # noqa: E402
    addition_prompt,
    chat_prompt,
    default_checkpoint,
    held_out_problems,
    is_correct,
)

CACHES = ("none", "prefix", "dual")
SAMPLERS = {
    "quota": {"sampler": "quota"},
    "threshold": {"sampler": "threshold", "threshold": 0.9},
    "factor": {"sampler": "factor", "factor": 1.0},
}


def few_shot(question: str, shots: int) -> str:
    # Solved examples from outside the held-out set (a + b with a, b in 10..99 and a sum >= 100).
    examples = [(10 + (7 * i) % 90, 99 - (5 * i) % 40) for i in range(shots)]
    lines = [f"{addition_prompt(a, b)} {a + b}" for a, b in examples]
    return "\n".join(lines + [question])


def run_once(model, tokenizer, prompts, settings):
    forwards = tokens = right = 0
    mx.clear_cache()  # the peak then counts this run's buffers, not the allocator's leftovers
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for prompt, expected in prompts:
        text, last = "", None
        for last in stream_generate_diffusion(model, tokenizer, prompt, **settings):
            text += last.text
        forwards += last.nfe
        tokens += last.generation_tokens
        right += is_correct(text, expected)
    return time.perf_counter() - tic, forwards, tokens, right, mx.get_peak_memory() / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shots", type=int, default=12)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    model, tokenizer = load(default_checkpoint())
    problems = held_out_problems(args.problems)
    prompts = [(chat_prompt(tokenizer, few_shot(q, args.shots)), a) for q, a in problems]
    n_prompt = len(tokenizer.encode(prompts[0][0]))
    print(
        f"default model, {args.shots}-shot prompt of {n_prompt} tokens, {args.problems} problems, "
        f"max_tokens {args.max_tokens}, block_length {args.block}, median of {args.runs} runs "
        "after a warm-up\n"
    )
    print("| cache | sampler | right | forwards | tokens / forward | wall s (median) | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for sampler, extra in SAMPLERS.items():
        for cache in CACHES:
            settings = dict(
                cache=cache, max_tokens=args.max_tokens, block_length=args.block, **extra
            )
            run_once(model, tokenizer, prompts, settings)  # warm-up
            runs = [run_once(model, tokenizer, prompts, settings) for _ in range(args.runs)]
            wall = statistics.median(r[0] for r in runs)
            _, forwards, tokens, right, peak = runs[-1]
            print(
                f"| {cache} | {sampler} | {right}/{len(prompts)} | {forwards} | "
                f"{tokens / max(forwards, 1):.2f} | {wall:.3f} | {peak:.0f} |"
            )


if __name__ == "__main__":
    main()
