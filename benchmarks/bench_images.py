"""Text-to-image cost of the unified families (issue #42): forwards per image against the
reference's, seconds per image and peak memory at the published model's widths, random weights.

    python benchmarks/bench_images.py [--families mmada lumina_dimoo] [--layers 1 2] \\
        [--size 256] [--steps-measured 1] [--vq-size 256] [--dtype bfloat16] [--json out.jsonl]
    python benchmarks/bench_images.py --tiny        # a few seconds: proves the script runs

The models: LLaDA 8B's width (tests/data/GSAI-ML__LLaDA-8B-Instruct: hidden 4096, 32 heads, MLP
12288) at `--layers` layers (the published 32 do not fit the shared 24 GB machine, as in
bench_cpu_dtypes.py), with MMaDA's tables resized to new_vocab_size 134,656 (its codebook of 8192
after LLaDA's 126,349 tokenizer ids) or Lumina-DiMOO's head of 134,548 rows (126,356 + 8192);
random weights, cast to `--dtype` (on MLX's CPU backend, models/cpu_layers.py's float32 matmuls
as `load` turns them on). A tokenizer in the fixtures' form holds LLaDA's special tokens at their
real ids (126,349 ids, so MMaDA's offset is its real 126,349).

Each image runs the package's own path (images.decoder_for, engine.maskgit's loop) at the
reference's settings: MMaDA's 15 steps under guidance 3.5, Lumina-DiMOO's 64 under cfg 4.0, both
with their unconditional rows in the same forward (2 rows a forward). The references' forwards
per image: MMaDA's t2i_generate also batches cond and uncond (15 forwards of 2 rows);
Lumina-DiMOO's generate_image runs them apart (128 forwards of 1 row). Only `--steps-measured`
steps run (every step is the same forward: the full prompt, the head over the image span); the
step time at each layer count is the median of those, and the seconds per image at the published
32 layers are extrapolated from two layer counts: a step = fixed (embedding, head, sampling) +
per-layer x layers, fitted through the two measurements (with one layer count given, the row
says "n/a"). Peak memory is MLX's over the measured steps, at the measured depth, and the
estimate at 32 layers adds 31 x one layer's weights of the measured dtype.

The VQ decoder is timed apart, at `--vq-size` pixels: MAGVIT-v2 (showlab/magvitv2's defaults,
MMaDA's `vq_model/`) and diffusers' VQModel at aMUSEd's config (Lumina-DiMOO's `vqvae/`), random
weights, float32, one image.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mlx_dllm_models.engine.maskgit import seeded_draws  # noqa: E402
from mlx_dllm_models.images import decoder_for, image_spec_of  # noqa: E402
from mlx_dllm_models.models import llada, magvitv2, mmada, vqmodel  # noqa: E402
from mlx_dllm_models.models.cpu_layers import use_float32_matmuls  # noqa: E402

DATA = ROOT / "tests" / "data" / "GSAI-ML__LLaDA-8B-Instruct" / "config.json"
DEPTH = 32
CODEBOOK = 8192
PROMPT = "A sea turtle swimming near a coral reef, photorealistic, soft morning light"

# family -> (config changes, reference forwards per step, rows per reference forward)
FAMILIES = {
    "mmada": (
        {
            "model_type": "mmada",
            "architectures": ["MMadaModelLM"],
            "llm_vocab_size": 126464,
            "new_vocab_size": 134656,
            "codebook_size": CODEBOOK,
            "num_vq_tokens": 1024,
        },
        1,
        2,
    ),
    "lumina_dimoo": (
        {
            "architectures": ["LLaDAForMultiModalGeneration"],
            "vocab_size": 126356 + CODEBOOK,
            "embedding_size": 126356 + CODEBOOK,
        },
        2,
        1,
    ),
}


def tokenizer(work: Path):
    """LLaDA's special tokens at their real ids, filled to 126,349 ids (built once)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    from fixtures.lumina_dimoo import DIMOO_TOKENS
    from mlx_dllm_models.tiny import build_tokenizer

    folder = work / "tokenizer"
    if not (folder / "tokenizer.json").exists():
        build_tokenizer(
            folder,
            DIMOO_TOKENS,
            bos_token="<|startoftext|>",
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            mask_token="<|mdm_mask|>",
        )
    return TokenizerWrapper(AutoTokenizer.from_pretrained(str(folder)))


def config(family: str, layers: int, tiny: bool) -> dict:
    cfg = json.loads(DATA.read_text())
    cfg.update(FAMILIES[family][0], n_layers=layers)
    if tiny:
        cfg.update(d_model=64, n_heads=4, n_kv_heads=4, mlp_hidden_size=128)
    return cfg


def build(family: str, cfg: dict, dtype):
    module = mmada if family == "mmada" else llada
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    use_float32_matmuls(model)
    return model


def layer_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.layers[0].parameters()))


class FixedVQ:
    """What decoder_for asks of a VQ model (the grid), without building one."""

    codebook_size = CODEBOOK
    downsample = 16


def measure_steps(model, tok, size: int, steps_measured: int):
    spec = image_spec_of(model)
    dec, _, steps, guidance = decoder_for(
        model, tok, [PROMPT], spec, FixedVQ(), size, size, None, None
    )
    entries = spec.codebook_size if spec.rule == "gumbel_max" else None
    draws = seeded_draws([0], dec.n_tokens, entries)
    mx.reset_peak_memory()
    times, last = [], time.perf_counter()
    for event in dec.run(
        steps=steps, guidance_scale=guidance, temperature=spec.temperature, draws=draws
    ):
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if len(times) >= steps_measured:
            break
    rows = dec.ids.shape[0] * (2 if guidance > 0 else 1)
    return {
        "steps": steps,
        "guidance": guidance,
        "rows_per_forward": rows,
        "prompt_columns": dec.ids.shape[1],
        "image_tokens": dec.n_tokens,
        "step_s": statistics.median(times),
        "peak_gb": mx.get_peak_memory() / 1e9,
    }


def vq_row(family: str, size: int, tiny: bool) -> dict:
    if family == "mmada":
        vq = magvitv2.MAGVITv2(magvitv2.VQConfig.from_dict({}))
    else:
        vq = vqmodel.VQModel(vqmodel.VQConfig())
    if tiny:
        size = 2 * vq.downsample
    mx.eval(vq.parameters())
    side = size // vq.downsample
    codes = mx.random.randint(0, vq.codebook_size, (1, side * side))
    mx.reset_peak_memory()
    start = time.perf_counter()
    mx.eval(vq.decode_code(codes, (side, side)))
    return {
        "vq_size": size,
        "vq_s": time.perf_counter() - start,
        "vq_peak_gb": mx.get_peak_memory() / 1e9,
    }


def image_rows(family, args, tok, dtype):
    per_step, ref_rows = FAMILIES[family][1:]
    measured = {}
    for layers in args.layers:
        model = build(family, config(family, layers, args.tiny), dtype)
        row = measure_steps(model, tok, args.size, args.steps_measured)
        row["layer_gb"] = layer_bytes(model) / 1e9
        measured[layers] = row
        del model
        mx.clear_cache()
    first = measured[args.layers[0]]
    out = dict(first, family=family, layers=list(measured))
    out["forwards_per_image"] = first["steps"]
    out["reference_forwards_per_image"] = first["steps"] * per_step
    out["reference_rows_per_forward"] = ref_rows
    out["step_s_by_layers"] = {str(k): v["step_s"] for k, v in measured.items()}
    out["peak_gb_by_layers"] = {str(k): v["peak_gb"] for k, v in measured.items()}
    if len(measured) >= 2:
        (l0, a), (l1, b) = list(measured.items())[:2]
        per_layer = (b["step_s"] - a["step_s"]) / (l1 - l0)
        fixed = a["step_s"] - per_layer * l0
        out["per_layer_step_s"], out["fixed_step_s"] = per_layer, fixed
        if per_layer > 0:  # below the timing noise (toy widths) the fit means nothing
            out["s_per_image_at_32"] = first["steps"] * (fixed + per_layer * DEPTH)
    extra = (DEPTH - args.layers[0]) * first["layer_gb"]
    out["peak_gb_at_32_est"] = first["peak_gb"] + extra
    return out


def table(rows) -> str:
    lines = [
        "| family | image | prompt columns | rows / forward | forwards / image (reference) "
        "| step s by layers | s / image at 32 layers (est.) | peak GB (32 est.) | VQ decode s "
        "(px) | VQ peak GB |",
        "|---|---|---:|---:|---|---|---:|---|---|---:|",
    ]
    for r in rows:
        steps = ", ".join(f"{k}: {v:.2f}" for k, v in r["step_s_by_layers"].items())
        est = r.get("s_per_image_at_32")
        peaks = ", ".join(f"{v:.2f}" for v in r["peak_gb_by_layers"].values())
        lines.append(
            f"| {r['family']} | {r['size']}x{r['size']}, {r['image_tokens']} tokens | "
            f"{r['prompt_columns']} | {r['rows_per_forward']} | {r['forwards_per_image']} "
            f"({r['reference_forwards_per_image']} of {r['reference_rows_per_forward']} row"
            f"{'s' if r['reference_rows_per_forward'] > 1 else ''}) | {steps} | "
            f"{'n/a' if est is None else f'{est:.0f}'} | {peaks} ({r['peak_gb_at_32_est']:.1f}) | "
            f"{r['vq_s']:.2f} ({r['vq_size']}) | {r['vq_peak_gb']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--layers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    p.add_argument("--steps-measured", type=int, default=1)
    p.add_argument("--vq-size", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--work", default="/tmp/bench_images")
    p.add_argument("--json", default=None, help="append the rows as JSON lines to this file")
    p.add_argument("--tiny", action="store_true", help="toy widths and sizes (a smoke run)")
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.steps_measured = 32, 1
    mx.random.seed(0)
    tok = tokenizer(Path(args.work))
    dtype = getattr(mx, args.dtype)
    rows = []
    for family in args.families:
        row = image_rows(family, args, tok, dtype)
        row.update(vq_row(family, args.vq_size, args.tiny), size=args.size, dtype=args.dtype)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
