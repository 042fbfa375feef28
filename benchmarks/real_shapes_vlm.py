"""mlx-vlm beside this package on the same converted checkpoint (LLaDA2.x, Nemotron): one block
decoded by each with the same sampler, runs alternating (benchmarks/bench_real_shapes.py's `_vlm`
phase)."""

import json
import re
import statistics
import sys
import time
from pathlib import Path

from real_shapes_phases import load_ours, random_prompt, resident_set


def phase_vlm(out, key, pairs):
    model, tok, swapped, _ = load_ours(out)
    result = versus_vlm(model, tok, out, pairs, bool(swapped))
    return dict(phase="vlm", key=key, rss_peak=resident_set()[1], **result)


def vlm_model(model, out, on_cpu_path):
    """mlx-vlm's model of the same family, given our model's 4-bit arrays (shared, no copy)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    cfg = json.loads((Path(out) / "config.json").read_text())
    if cfg["model_type"] == "llada2_moe":
        from mlx_vlm.models.llada2_moe import Model
        from mlx_vlm.models.llada2_moe.config import ModelConfig

        renames = [(r"\.mlp\.gate\.gate_proj\.", ".mlp.gate.")]
    else:
        from mlx_vlm.models.nemotron_labs_diffusion import Model, ModelConfig

        renames = [(r"^encoder\.", "model.")]
    vlm = Model(ModelConfig.from_dict(cfg))
    ours = dict(tree_flatten(model.parameters()))

    def theirs(k):
        for a, b in renames:
            k = re.sub(a, b, k)
        return "language_model." + k

    mapped = {theirs(k): v for k, v in ours.items()}
    q = cfg.get("quantization", {})

    def predicate(path, module):
        if f"{path}.scales" not in mapped:
            return False
        return {"group_size": q["group_size"], "bits": q["bits"], "mode": q.get("mode", "affine")}

    # Our 8-bit / unquantized exceptions follow the arrays: a layer is quantized with the width
    # its packed weight says.
    def width(path, module):
        p = predicate(path, module)
        if p and hasattr(module, "weight"):
            packed = mapped[f"{path}.weight"].shape[-1]
            p["bits"] = 32 * packed // module.weight.shape[-1]
        return p

    nn.quantize(vlm, class_predicate=width)
    have = dict(tree_flatten(vlm.parameters()))
    missing, extra = set(have) - set(mapped), set(mapped) - set(have)
    if missing or extra:
        raise SystemExit(f"mlx-vlm names: missing {sorted(missing)[:4]} extra {sorted(extra)[:4]}")
    vlm.load_weights(list(mapped.items()))
    if on_cpu_path:
        from mlx_vlm.models import switch_layers as vsl

        from mlx_dllm_models.models import cpu_layers

        for _, m in vlm.named_modules():
            if type(m) is vsl.QuantizedSwitchLinear:
                m.__class__ = cpu_layers.CPUQuantizedSwitchLinear
            elif type(m) is vsl.SwitchLinear:
                m.__class__ = cpu_layers.CPUSwitchLinear
        cpu_layers.use_float32_matmuls(vlm)
    return vlm


def versus_vlm(model, tok, out, pairs, on_cpu_path):
    """One block, temperature 0, the same sampler in both; runs alternate."""
    import mlx.core as mx
    import numpy as np

    from mlx_dllm_models import stream_generate_diffusion

    vlm = vlm_model(model, out, on_cpu_path)
    spec = model.diffusion_spec
    rng = np.random.default_rng(1)
    prompt = random_prompt(model, rng, VLM_PROMPT)
    eos = set(spec.eos_token_ids)
    block = spec.trained_block_length or 32
    # steps = block: each engine's threshold rule with a floor of one token a step (with fewer
    # steps mlx-vlm's LLaDA2 loop still commits one token a step and stops after `steps`).
    steps = block
    threshold = 0.95 if model.args.model_type == "llada2_moe" else 0.9
    ours_kw = dict(
        max_tokens=block,
        block_length=block,
        steps=steps,
        sampler="threshold",
        threshold=threshold,
        temperature=0,
    )
    vlm_kw = dict(
        block_length=block, steps=steps, gen_length=block, threshold=threshold, eos_early_stop=True
    )
    if model.args.model_type != "llada2_moe":
        vlm_kw["sampler"] = "native"
    label = f"block {block}, {steps} steps, threshold {threshold}"

    def ours():
        tic = time.perf_counter()
        toks, last = [], None
        for last in stream_generate_diffusion(model, tok, prompt, **ours_kw):
            toks += last.tokens
        return toks, last.nfe, time.perf_counter() - tic

    inner = vlm.language_model.model
    cls, calls = type(inner), [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return cls.__call__(self, *a, **k)

    # mlx-vlm reports no forward count: count calls of its transformer body.
    inner.__class__ = type(cls.__name__, (cls,), {"__call__": counted})

    def theirs():
        calls[0] = 0
        tic = time.perf_counter()
        o = vlm.language_model.generate(mx.array([prompt]), **vlm_kw)
        mx.eval(o)
        toks = [int(t) for t in np.array(o).reshape(-1)]
        cut = next((i for i, t in enumerate(toks) if t in eos), None)
        return toks if cut is None else toks[:cut], calls[0], time.perf_counter() - tic

    runs = {"ours": [], "vlm": []}
    for i in range(pairs):
        order = [("ours", ours), ("vlm", theirs)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            runs[name].append(fn())
            print(name, runs[name][-1][1:], file=sys.stderr, flush=True)
    a = statistics.median(r[2] for r in runs["ours"])
    b = statistics.median(r[2] for r in runs["vlm"])
    ta, tb = runs["ours"][-1][0], runs["vlm"][-1][0]
    return dict(
        settings=label,
        prompt=len(prompt),
        pairs=pairs,
        ours_s=a,
        vlm_s=b,
        ours_tokens=len(ta),
        vlm_tokens=len(tb),
        ours_nfe=runs["ours"][-1][1],
        vlm_forwards=runs["vlm"][-1][1],
        tok_s_ratio=(len(ta) / a) / (len(tb) / b) if tb else None,
        tokens_equal=ta == tb[: len(ta)] and len(ta) == len(tb),
        first_difference=next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None),
    )


VLM_PROMPT = 128
