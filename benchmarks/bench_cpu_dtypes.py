"""Seconds per denoising step on MLX's CPU backend by weight form, before and after the float32
path of models/cpu_layers.py (issue #28).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/bench_cpu_dtypes.py [--families llada llada2 nemotron] \\
        [--prompts 512 2048] [--forms bf16 q4 q8] [--steps 3] [--before-prompts 512] \\
        [--before-forms bf16 q4 q8]

Real widths from the configs in tests/data (random weights, few layers, the real vocabulary):

* llada: LLaDA-8B (hidden 4096, MLP 12288, 32 heads, vocabulary 126,464), 1 layer. Bidirectional:
  a step is the default backend's forward over the whole window (prompt + the 32-token block),
  the LM head over the block's rows.
* llada2: LLaDA2.0-mini (hidden 2048, 256 experts of 512, top-8, one shared expert; vocabulary
  157,184), 2 layers: the dense first layer and one MoE layer. A step is the prefix cache's
  forward over the open block (32 rows) against the prompt's cached K/V.
* nemotron: Nemotron-Labs-Diffusion-8B (hidden 4096, MLP 14336, 32 / 8 heads, vocabulary
  131,072), 2 layers; a step as llada2's (the causal-prefix cache).

Forms: float32, bf16 (the published form), q4 / q8 (mlx-lm's default quantization of the bf16
weights: group 64, bfloat16 scales, the family's quant_predicate). The float32 model stays loaded
and its step alternates with the form's, step by step, so that the machine's load hits both
alike: "x f32" is the median of those pairs' ratios. "before" is the same instance with its
layers' own classes (mlx's bf16 / quantized kernels, bf16 activations), one step (they take
minutes: --before-prompts and --before-forms choose where they run). The prompt's K/V are prefilled once by the
float32 model and cast to the activation dtype of each path. "floor" is the step's float32 FLOPs
(every matmul, attention included) over the rate of one large float32 matmul measured at start.
"""

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_dllm_models.cache import PrefixKVCache  # noqa: E402
from mlx_dllm_models.models.cpu_layers import (  # noqa: E402
    restore_layers,
    use_float32_matmuls,
)

DATA = ROOT / "tests" / "data"
BLOCK = 32

FAMILIES = {
    "llada": ("GSAI-ML__LLaDA-8B-Instruct", "n_layers", 1, "full"),
    "llada2": ("inclusionAI__LLaDA2.0-mini", "num_hidden_layers", 2, "prefix"),
    "nemotron": ("nvidia__Nemotron-Labs-Diffusion-8B", "num_hidden_layers", 2, "prefix"),
}
FORMS = {"bf16": None, "q4": 4, "q8": 8}


def config_of(family, layers):
    folder, key, default, _ = FAMILIES[family]
    cfg = json.loads((DATA / folder / "config.json").read_text())
    cfg[key] = layers or default
    return cfg


def build(cfg):
    module = importlib.import_module(f"mlx_dllm_models.models.{cfg['model_type']}")
    return module.Model(module.ModelArgs.from_dict(cfg))


def narrowed(cfg, base, form):
    """A second model holding `base`'s weights in `form` (its own random initialisation is never
    evaluated: replaced while still lazy)."""
    model = build(cfg)
    keep = getattr(model, "cast_predicate", lambda key: True)
    model.load_weights(
        [
            (k, v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) and keep(k) else v)
            for k, v in tree_flatten(base.parameters())
        ]
    )
    bits = FORMS[form]
    if bits:
        own = getattr(model, "quant_predicate", None)

        def predicate(path, module):
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 64:
                return False
            return own(path, module) if own else True

        nn.quantize(model, group_size=64, bits=bits, class_predicate=predicate)
    mx.eval(model.parameters())
    return model


def gflops_rate():
    a, b = mx.random.normal((2048, 4096)), mx.random.normal((4096, 4096))
    mx.eval(a, b)
    times = []
    for _ in range(4):
        tic = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - tic)
    return 2 * 2048 * 4096 * 4096 / statistics.median(times[1:]) / 1e9


def step_flops(model, cfg, rows, keys, head_rows):
    """Multiply-adds x 2 of one forward: every Linear over `rows`, the experts each row selects,
    the head over `head_rows`, attention's two products over `keys`."""
    flops = 0
    top_k = cfg.get("num_experts_per_tok", 1)
    head = {id(model.get("lm_head")), id(model.get("diffusion_head"))}
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear) and id(m) not in head:
            flops += 2 * rows * m.weight.shape[0] * m.weight.shape[1]
        elif type(m).__name__ == "SwitchLinear":
            flops += 2 * rows * top_k * m.weight.shape[1] * m.weight.shape[2]
    hidden = cfg.get("hidden_size") or cfg["d_model"]
    vocab = cfg.get("embedding_size") or cfg["vocab_size"]
    flops += 2 * head_rows * hidden * vocab
    heads = cfg.get("num_attention_heads") or cfg["n_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    flops += 4 * rows * keys * heads * head_dim * len(model.layers)
    return flops


class Stepper:
    """One family's step at one prompt length, for any model of the family."""

    def __init__(self, family, base, prompt):
        self.kind = FAMILIES[family][3]
        self.prompt = prompt
        vocab = base.args.vocab_size
        self.tokens = mx.random.randint(0, vocab, (1, prompt + BLOCK))
        self.kv = {}
        if self.kind == "prefix":
            cache = PrefixKVCache(len(base.layers), prompt + BLOCK)
            base(self.tokens[:, :prompt], cache=cache.at(0), mask="causal", head_span=(0, 1))
            mx.eval([(c.keys, c.values) for c in cache])
            self.kv[mx.float32] = cache

    def cache(self, dtype):
        if dtype not in self.kv:
            src = self.kv[mx.float32]
            out = PrefixKVCache(len(src.layers), src.width)
            for new, old in zip(out.layers, src.layers):
                new.keys, new.values = old.keys.astype(dtype), old.values.astype(dtype)
            mx.eval([(c.keys, c.values) for c in out])
            self.kv[dtype] = out
        cache = self.kv[dtype]
        cache.commit(self.prompt)
        return cache.at(self.prompt)

    def __call__(self, model, dtype=mx.float32):
        """Seconds of one step; `dtype`: the activations' (the K/V cache's)."""
        tic = time.perf_counter()
        if self.kind == "full":
            out = model(self.tokens, head_span=(self.prompt, self.prompt + BLOCK))
            mx.eval(out)
        else:
            cache = self.cache(dtype)
            out = model(self.tokens[:, self.prompt :], cache=cache, mask=None)
            mx.eval(out, [(c.keys, c.values) for c in cache])
        return time.perf_counter() - tic


def forward_dtype(model):
    """The dtype a forward computes in: its embedding's output."""
    emb = next(m for _, m in model.named_modules() if hasattr(m, "as_linear"))
    return emb(mx.array([0])).dtype


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--prompts", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--forms", nargs="+", default=list(FORMS))
    ap.add_argument("--steps", type=int, default=3, help="timed pairs per row, after a warm-up")
    ap.add_argument("--before-prompts", nargs="*", type=int, default=[512])
    ap.add_argument(
        "--before-forms", nargs="*", default=list(FORMS), help="forms with a before row"
    )
    ap.add_argument("--layers", type=int, default=None, help="override each family's layers")
    args = ap.parse_args()

    rate = gflops_rate()
    print(f"mlx {mx.__version__}, {mx.default_device()}; float32 matmul {rate:.0f} GFLOP/s")
    print(
        "| model | prompt | rows / step | form | before s | after s | after x f32 "
        "| floor s | transient GB |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for family in args.families:
        cfg = config_of(family, args.layers)
        mx.random.seed(0)
        base = build(cfg)
        mx.eval(base.parameters())
        label = f"{family} ({cfg.get('n_layers') or cfg.get('num_hidden_layers')} layers)"
        for prompt in args.prompts:
            step = Stepper(family, base, prompt)
            rows = prompt + BLOCK if step.kind == "full" else BLOCK
            floor = step_flops(base, cfg, rows, prompt + BLOCK, BLOCK) / rate / 1e9
            step(base)  # warm-up
            f32 = statistics.median(step(base) for _ in range(args.steps))
            print(
                f"| {label} | {prompt} | {rows} | float32 | | {f32:.2f} | 1.00 | {floor:.2f} | |",
                flush=True,
            )
            for form in args.forms:
                model = narrowed(cfg, base, form)
                before = ""
                if prompt in args.before_prompts and form in args.before_forms:
                    restore_layers(model)
                    try:
                        before = f"{step(model, forward_dtype(model)):.2f}"
                    except RuntimeError as e:
                        before = f"fails ({str(e).split(']')[0].strip('[')})"
                    mx.clear_cache()  # its buffers (bf16 activations) are of no use after
                use_float32_matmuls(model)
                step(model)  # warm-up (compiles the unpacking kernels)
                pairs, peak = [], 0.0
                for _ in range(args.steps):
                    f = step(base)
                    held = mx.get_active_memory()
                    mx.reset_peak_memory()
                    pairs.append((f, step(model)))
                    peak = max(peak, (mx.get_peak_memory() - held) / 1e9)
                after = statistics.median(b for _, b in pairs)
                ratio = statistics.median(b / a for a, b in pairs)
                print(
                    f"| {label} | {prompt} | {rows} | {form} | {before} | {after:.2f} "
                    f"| {ratio:.2f} | {floor:.2f} | {peak:.1f} |",
                    flush=True,
                )
                del model
                gc.collect()
                mx.clear_cache()  # the next form widens into buffers of other sizes
            del step
            gc.collect()
        del base
        gc.collect()


if __name__ == "__main__":
    main()
