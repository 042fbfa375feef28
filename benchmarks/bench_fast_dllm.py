"""Fast-dLLM's approximate caches (cache="prefix" / "dual") against full recompute (cache="none"),
for the quota, threshold and factor samplers, on the embedded default model with long few-shot
prompts; plus a plain PyTorch loop (issue #14 section 2).

    python benchmarks/bench_fast_dllm.py [--shots 7 16] [--problems 200] [--timed 8] [--runs 3]

The prompts are the default task's few-shot form (mlx_dllm_models.default.few_shot_message: solved
examples, then the held-out question; 7 shots make about 256 tokens, 15 about 475), decoded with
the checkpoint's generation config (16 new tokens in blocks of 8). For each setting:

* accuracy over --problems held-out questions (decoded in batches of 25: left-padded batches give
  each prompt's own tokens, tests/test_fast_dllm_cache.py);
* latency over the first --timed of them one at a time (batch 1, what an interactive user gets):
  the median over --runs runs (after a warm-up) of the wall time per question, forwards and tokens
  per forward per question, and peak memory.

The PyTorch row is a transcription of LLaDA's generate.py (tests/reference/llada_torch.py, quota
sampler = low_confidence remasking, full recompute) over a transformers Llama holding the same
weights, at torch.set_num_threads(--torch-threads, default 2): what a Linux user without this package would run. Its
accuracy is over the same questions, one at a time. The machine may be shared: compare rows of one
run, never absolute numbers across machines.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion  # noqa: E402
from mlx_dllm_models.default import (  # noqa: E402
    chat_prompt,
    default_checkpoint,
    few_shot_message,
    held_out_problems,
    is_correct,
)

CACHES = ("none", "prefix", "dual")
SAMPLERS = {
    "quota": {"sampler": "quota"},
    "threshold 0.9": {"sampler": "threshold", "threshold": 0.9},
    "factor 1.0": {"sampler": "factor", "factor": 1.0},
}
CHUNK = 25


def accuracy(model, tokenizer, prompts, settings):
    right = 0
    for i in range(0, len(prompts), CHUNK):
        chunk = prompts[i : i + CHUNK]
        out = batch_generate_diffusion(model, tokenizer, [p for p, _ in chunk], **settings)
        right += sum(is_correct(t, a) for t, (_, a) in zip(out.texts, chunk))
    return right / len(prompts)


def timed_run(model, tokenizer, prompts, settings):
    """Per question, one at a time: (wall s, forwards, tokens) summed; peak memory MiB."""
    forwards = tokens = 0
    mx.clear_cache()  # the peak then counts this run's buffers, not the allocator's leftovers
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for prompt, _ in prompts:
        for last in stream_generate_diffusion(model, tokenizer, prompt, **settings):
            pass
        forwards += last.nfe
        tokens += last.generation_tokens
    return time.perf_counter() - tic, forwards, tokens, mx.get_peak_memory() / 2**20


def torch_row(path, spec, tokenizer, prompts, timed, gen, block, runs, threads):
    # torch is a test dependency: imported only for this row.
    import torch

    from reference.llada_torch import llada_generate, torch_forward

    torch.set_num_threads(threads)
    forward = torch_forward(path)
    eos = set(spec.eos_token_ids)

    def answer(prompt):
        ids = np.array([tokenizer.encode(prompt, add_special_tokens=False)])
        x, nfe = llada_generate(
            forward, ids, gen, gen, block, mask_id=spec.mask_token_id, return_nfe=True
        )
        new = [int(t) for t in x[0, ids.shape[1] :]]
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        return tokenizer.decode(new[:cut]), nfe

    right = sum(is_correct(answer(p)[0], a) for p, a in prompts)
    answer(timed[0][0])  # warm-up
    walls, nfe = [], 0
    for _ in range(runs):
        tic = time.perf_counter()
        nfe = sum(answer(p)[1] for p, _ in timed)
        walls.append(time.perf_counter() - tic)
    return right / len(prompts), statistics.median(walls), nfe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shots", type=int, nargs="+", default=[7, 15])
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--timed", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    # torch's threads spin while they wait: on cores other jobs use, 2 threads ran a forward of the
    # default model 40x slower than 1 (measured); on an idle machine use 2.
    ap.add_argument("--torch-threads", type=int, default=2)
    args = ap.parse_args()

    path = default_checkpoint()
    model, tokenizer = load(path)
    gen = model.generation_config.get("max_new_tokens", 16)
    block = model.generation_config.get("block_length", 8)
    print(f"mlx {mx.__version__}, {mx.default_device()}; {gen} new tokens, blocks of {block}")
    for shots in args.shots:
        problems = held_out_problems(args.problems)
        prompts = [
            (chat_prompt(tokenizer, few_shot_message(q, shots, seed=i)), a)
            for i, (q, a) in enumerate(problems)
        ]
        timed = prompts[: args.timed]
        lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p, _ in prompts]
        print(
            f"\n{shots} shots: prompts of {min(lengths)}-{max(lengths)} tokens (median "
            f"{statistics.median(lengths):.0f}); accuracy over {len(prompts)} questions, latency "
            f"over {len(timed)} one at a time, median of {args.runs} runs\n"
        )
        print(
            "| cache | sampler | accuracy | forwards / question | tokens / forward "
            "| s / question | vs none + quota | peak MiB |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        base = None
        for sampler, extra in SAMPLERS.items():
            for cache in CACHES:
                settings = dict(cache=cache, max_tokens=gen, block_length=block, **extra)
                acc = accuracy(model, tokenizer, prompts, settings)
                timed_run(model, tokenizer, timed, settings)  # warm-up
                runs = [timed_run(model, tokenizer, timed, settings) for _ in range(args.runs)]
                wall = statistics.median(r[0] for r in runs) / len(timed)
                _, forwards, tokens, peak = runs[-1]
                base = base or wall
                print(
                    f"| {cache} | {sampler} | {acc:.3f} | {forwards / len(timed):.1f} "
                    f"| {tokens / max(forwards, 1):.2f} | {wall:.3f} | {base / wall:.1f}x "
                    f"| {peak:.0f} |",
                    flush=True,
                )
        if not args.no_torch:
            acc, wall, nfe = torch_row(
                path,
                model.diffusion_spec,
                tokenizer,
                prompts,
                timed,
                gen,
                block,
                args.runs,
                args.torch_threads,
            )
            wall /= len(timed)
            print(
                f"| PyTorch loop (LLaDA generate.py, transformers) | quota | {acc:.3f} "
                f"| {nfe / len(timed):.1f} | | {wall:.3f} | {base / wall:.1f}x | |",
                flush=True,
            )


if __name__ == "__main__":
    main()
