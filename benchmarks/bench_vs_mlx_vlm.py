"""This package against mlx-vlm (the peer that runs LLaDA2 and Nemotron-Labs-Diffusion today), on
the same random weights, in the same process, at batch 1.

    python benchmarks/bench_vs_mlx_vlm.py [--prompt 128] [--max-tokens 128] [--runs 3]

The checkpoints are larger-than-fixture random models written by the test fixtures' own builders
(exact HF layout), loaded by each package through its own loader. Both sides decode at temperature
0 with the same settings; the table reports forwards (NFE), tokens per forward, tok/s and the
speed ratio, medians of --runs runs after a warm-up, and whether the tokens agree. The machine is
shared and noisy: compare the two rows of one family within one run.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mlx_dllm_models_hook  # noqa: E402,F401
from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion  # noqa: E402
from mlx_dllm_models.tiny import write_checkpoint  # noqa: E402


def build_llada2(path):
    from fixtures import llada2 as fx

    cfg = fx.config(head_dim=64)
    cfg.update(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=6,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        rotary_dim=32,
        max_position_embeddings=4096,
    )
    write_checkpoint(path, cfg, soften_head(fx.tensors(cfg), "lm_head.weight"))
    _copy_tokenizer(fx, path)
    return path, cfg


def soften_head(tensors, name, factor=0.3):
    """The fixtures' heads are sharpened for tiny models; at this width they would push many
    confidences to float32's 1.0, where ties make any two implementations order positions
    differently. A softer head keeps the comparison about speed."""
    tensors[name] = tensors[name] * factor
    return tensors


def _copy_tokenizer(fx, path):
    with tempfile.TemporaryDirectory() as tmp:
        small = fx.build(Path(tmp) / "small")
        for f in small.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                (Path(path) / f.name).write_bytes(f.read_bytes())


def build_nemotron(path):
    from fixtures import nemotron as fx

    for k, v in dict(
        HIDDEN=512, HEADS=8, KV_HEADS=2, HEAD_DIM=64, LAYERS=6, INTERMEDIATE=1536, ORIGINAL_MAX=4096
    ).items():
        setattr(fx, k, v)
    cfg = fx.config()
    write_checkpoint(path, cfg, soften_head(fx.tensors(), "diffusion_head.weight"))
    _copy_tokenizer(fx, path)
    return path, cfg


def vlm_model(family, path):
    cfg = json.loads((Path(path) / "config.json").read_text())
    if family == "llada2":
        from mlx_vlm.models.llada2_moe import Model
        from mlx_vlm.models.llada2_moe.config import ModelConfig
    else:
        from mlx_vlm.models.nemotron_labs_diffusion import Model, ModelConfig
    model = Model(ModelConfig.from_dict(cfg))
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    model.load_weights(list(model.sanitize(weights).items()))
    mx.eval(model.parameters())
    model.forward_calls = count_forwards(model)
    return model


def run_ours(model, tok, prompt, settings):
    tic = time.perf_counter()
    out, last = [], None
    for last in stream_generate_diffusion(model, tok, prompt, **settings):
        out.extend(last.tokens)
    return out, last.nfe, time.perf_counter() - tic


def count_forwards(vlm):
    """mlx-vlm does not report forwards for LLaDA2: count calls of its transformer body."""
    inner = vlm.language_model.model
    cls = type(inner)
    calls = [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return cls.__call__(self, *a, **k)

    inner.__class__ = type(cls.__name__, (cls,), {"__call__": counted})
    return calls


def run_vlm(model, prompt, kw, eos):
    calls = model.forward_calls
    calls[0] = 0
    tic = time.perf_counter()
    out = model.language_model.generate(mx.array([prompt]), **kw)
    mx.eval(out)
    wall = time.perf_counter() - tic
    toks = [int(t) for t in np.array(out).reshape(-1)]
    cut = next((i for i, t in enumerate(toks) if t in eos), None)
    toks = toks if cut is None else toks[:cut]
    return toks, calls[0], wall


def median_runs(fn, runs):
    fn()
    results = [fn() for _ in range(runs)]
    return (
        results[0][0],
        statistics.median(r[1] or 0 for r in results),
        statistics.median(r[2] for r in results),
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"prompt {args.prompt} tokens, max_tokens {args.max_tokens}, temperature 0, "
        f"batch 1; medians of {args.runs} runs after a warm-up"
    )
    print(
        f"{'family / engine':40s} {'NFE':>5s} {'tokens':>6s} {'tok/fwd':>7s} {'tok/s':>8s} {'ratio':>6s} same"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for family, builder in (("llada2", build_llada2), ("nemotron", build_nemotron)):
            path, cfg = builder(Path(tmp) / family)
            model, tok = load(path)
            vlm = vlm_model(family, path)
            spec = model.diffusion_spec
            vocab = cfg["vocab_size"]
            # byte tokens only: ids below 10 include pad, which mlx-vlm masks out of a prompt
            prompt = [int(t) for t in rng.integers(10, 250, size=args.prompt)]
            eos = set(spec.eos_token_ids)
            if family == "llada2":
                ours_kw = dict(
                    max_tokens=args.max_tokens,
                    block_length=32,
                    steps=32,
                    sampler="threshold",
                    threshold=0.95,
                )
                vlm_kw = dict(
                    block_length=32,
                    steps=32,
                    gen_length=args.max_tokens,
                    threshold=0.95,
                    eos_early_stop=True,
                )
            else:
                # the fixture's trained block size (mlx-vlm ignores the checkpoint's: pass it)
                block = spec.trained_block_length
                ours_kw = dict(max_tokens=args.max_tokens, block_length=block, steps=block)
                vlm_kw = dict(
                    block_length=block,
                    steps=block,
                    gen_length=args.max_tokens,
                    threshold=None,
                    sampler="native",
                    eos_early_stop=True,
                )
            a_tok, a_nfe, a_s = median_runs(
                lambda: run_ours(model, tok, prompt, ours_kw), args.runs
            )
            b_tok, b_nfe, b_s = median_runs(lambda: run_vlm(vlm, prompt, vlm_kw, eos), args.runs)
            n = max(len(a_tok), 1)
            label = f"{family} (block {ours_kw['block_length']}, {ours_kw.get('sampler', 'quota')})"
            print(label)
            print(
                f"{'  mlx-dllm-models':40s} {a_nfe:5.0f} {len(a_tok):6d} {len(a_tok) / max(a_nfe, 1):7.2f} "
                f"{len(a_tok) / a_s:8.1f} {b_s / a_s:6.2f} {a_tok == b_tok[: len(a_tok)]}"
            )
            print(
                f"{'  mlx-vlm 0.7.10':40s} {b_nfe:5.0f} {len(b_tok):6d} "
                f"{len(b_tok) / max(b_nfe or 1, 1):7.2f} {len(b_tok) / b_s:8.1f} {1.0:6.2f}"
            )
            del vocab, n
            # Batch > 1, which mlx-vlm refuses: 4 prompts at once vs the same 4 one after another.
            prompts = [prompt] + [
                [int(t) for t in rng.integers(10, 250, size=args.prompt)] for _ in range(3)
            ]
            one = lambda: [run_ours(model, tok, p, ours_kw) for p in prompts]  # noqa: E731

            def many():
                tic = time.perf_counter()
                out = batch_generate_diffusion(model, tok, prompts, **ours_kw)
                return out.tokens, out.nfe, time.perf_counter() - tic

            one()
            singles = [one() for _ in range(args.runs)]
            t_one = statistics.median(sum(r[2] for r in run) for run in singles)
            n_one = sum(len(r[0]) for r in singles[0])
            b_toks, b_nfe, t_many = median_runs(many, args.runs)
            n_many = sum(len(t) for t in b_toks)
            same = b_toks == [r[0] for r in singles[0]]
            print(
                f"{'  batch of 4, one by one':40s} {sum(r[1] for r in singles[0]):5d} {n_one:6d} {'':7s} "
                f"{n_one / t_one:8.1f} {1.0:6.2f}"
            )
            print(
                f"{'  batch of 4, batched':40s} {b_nfe:5.0f} {n_many:6d} {'':7s} "
                f"{n_many / t_many:8.1f} {t_one / t_many:6.2f} {same}"
            )


if __name__ == "__main__":
    main()
