"""Speed/quality curve on the trained default: task accuracy against forwards per generated token.

    python benchmarks/bench_quality.py [--model PATH] [--problems 200] [--markdown]

Runs the fixed held-out set of mlx_dllm_models.default (additions of two-digit numbers the model
never saw) one prompt at a time through the chat template, as `mlx_dllm generate` does, for
each sampler at several settings (quota at several step counts, threshold, factor, entropy bound)
and each cache the family offers (engine.cache_choices). Greedy (temperature 0).

Columns: accuracy (exact answer), forwards per generated token (model forwards / answer tokens,
EOS excluded; lower is faster), mean forwards per problem, and tokens per second (wall clock: the
machine may be shared, compare rows of one run only).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_TOKENS = 16
BLOCK_LENGTH = 8


def sampler_grid(block_length):
    steps = sorted({s for s in (1, 2, 4, block_length) if s <= block_length})
    grid = [dict(sampler="quota", steps=s) for s in steps]
    grid += [dict(sampler="threshold", threshold=v) for v in (0.5, 0.7, 0.9, 0.99)]
    grid += [dict(sampler="factor", factor=v) for v in (0.5, 1.0, 2.0, 4.0)]
    grid += [dict(sampler="entropy", entropy_bound=v) for v in (0.01, 0.1, 0.5, 1.0)]
    return grid


def run(model, tokenizer, problems, settings):
    from mlx_dllm_models import stream_generate_diffusion
    from mlx_dllm_models.default import chat_prompt, is_correct

    correct = nfe = tokens = 0
    tic = time.perf_counter()
    for message, answer in problems:
        text, last = "", None
        for last in stream_generate_diffusion(
            model, tokenizer, chat_prompt(tokenizer, message), **settings
        ):
            text += last.text
        correct += is_correct(text, answer)
        nfe += last.nfe
        tokens += last.generation_tokens
    wall = time.perf_counter() - tic
    n = len(problems)
    return {
        "accuracy": correct / n,
        "fwd_per_token": nfe / max(tokens, 1),
        "fwd_per_problem": nfe / n,
        "tps": tokens / wall,
    }


def label(settings):
    keys = ("sampler", "steps", "threshold", "factor", "entropy_bound", "cache")
    return ", ".join(f"{k}={settings[k]}" for k in keys if k in settings)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--block-length", type=int, default=BLOCK_LENGTH)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()

    from mlx_dllm_models import load
    from mlx_dllm_models.default import default_checkpoint, held_out_problems
    from mlx_dllm_models.engine import cache_choices
    from mlx_dllm_models.request import checkpoint_settings
    from mlx_dllm_models.settings import resolve_settings

    path = args.model or default_checkpoint()
    model, tokenizer = load(path)
    spec = model.diffusion_spec
    problems = held_out_problems(args.problems)
    base = dict(max_tokens=args.max_tokens, block_length=args.block_length, temperature=0.0)
    caches = list(cache_choices(spec.attention)[1:])
    print(
        f"model: {path} ({spec.family}); {len(problems)} held-out problems; "
        f"max_tokens={args.max_tokens}, block_length={args.block_length}, greedy; "
        f"caches offered by the family: {', '.join(caches)}"
    )
    rows = []
    # What `mlx_dllm generate` runs (the checkpoint's generation_config over the family's defaults),
    # then the family's defaults alone: LLaDA's long canvas, far longer than the answers.
    d = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    f = resolve_settings(spec, {}, {})
    for name, settings in (
        (
            f"CLI defaults: max_tokens={d.max_tokens}, block_length={d.block_length}, "
            f"sampler={d.sampler}, steps={d.steps}",
            {},
        ),
        (
            f"family defaults: max_tokens={f.max_tokens}, block_length={f.block_length}, "
            f"sampler={f.sampler}, steps={f.steps}",
            {k: getattr(f, k) for k in ("max_tokens", "block_length", "sampler", "steps")},
        ),
    ):
        r = run(model, tokenizer, problems, settings)
        rows.append((name, r))
        if not args.markdown:
            print(
                f"{name}\n{'':44s} acc {r['accuracy']:.3f}  fwd/token {r['fwd_per_token']:.2f}  "
                f"fwd/problem {r['fwd_per_problem']:.2f}  tok/s {r['tps']:.0f}",
                flush=True,
            )
    for cache in caches:
        for grid in sampler_grid(args.block_length):
            settings = dict(base, cache=cache, **grid)
            settings.setdefault("steps", args.block_length)
            r = run(model, tokenizer, problems, settings)
            rows.append((label(dict(grid, cache=cache)), r))
            if not args.markdown:
                print(
                    f"{rows[-1][0]:44s} acc {r['accuracy']:.3f}  fwd/token {r['fwd_per_token']:.2f}  "
                    f"fwd/problem {r['fwd_per_problem']:.2f}  tok/s {r['tps']:.0f}",
                    flush=True,
                )
    if args.markdown:
        print()
        print("| settings | accuracy | forwards / token | forwards / problem | tok/s |")
        print("|---|---:|---:|---:|---:|")
        for name, r in rows:
            print(
                f"| {name} | {r['accuracy']:.3f} | {r['fwd_per_token']:.2f} | "
                f"{r['fwd_per_problem']:.2f} | {r['tps']:.0f} |"
            )


if __name__ == "__main__":
    main()
