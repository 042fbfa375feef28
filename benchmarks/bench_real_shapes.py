"""Real shapes, measured (issue #25 section 3): a random-weight checkpoint at a published config's
exact shapes, in the exact Hugging Face layout, through plain mlx-lm's convert and load, then
generation, with the memory and the step cost measured.

    python benchmarks/bench_real_shapes.py run sdar-1.7b [--work DIR] [--prompts 512] [--steps 3]
    python benchmarks/bench_real_shapes.py write nemotron-3b DIR      # the checkpoint only
    python benchmarks/bench_real_shapes.py list                       # the sizes and their sources

One checkpoint at a time, each phase in its own subprocess so that each peak is its own:

1. write: config.json (and generation_config.json) from tests/data/<checkpoint>/, the real weight
   names (model.safetensors.index.json from tests/data where it was found, else the family's test
   fixture's names repeated over the real layer count), each tensor's shape from the family's
   model built lazily at the real config (the shape `sanitize` maps it onto; checked: `sanitize` of
   lazy placeholders gives exactly the model's parameters, names and shapes), written one tensor at
   a time in bfloat16 into safetensors shards of about 2 GB with model.safetensors.index.json.
   Values: uniform noise of variance 1 / fan_in, norms at 1, biases 0, embeddings of variance 1
   (the mask token's row at 0.05 of that, as the fixtures), an untied output head scaled so that
   a logit has a standard deviation of HEAD_LOGIT_STD (predictions far from uniform). A
   tokenizer in the fixtures' form (one token per byte, no merges) holding the checkpoint's special
   tokens at their real ids, filled to the real vocabulary size; the real chat template where
   tests/data has it. No real tokenizer.json exists here.
2. convert: `python -m mlx_lm convert --hf-path <ckpt> --mlx-path <out> -q` (4 bit, group 64),
   the peak RSS of that process (os.wait4), seconds, bytes on disk of input and output.
3. load: plain `mlx_lm.load(out)` in a fresh interpreter: RSS after the imports, peak RSS, MLX's
   peak, the weight bytes held (parameters' nbytes).
4. generate, at each --prompts length: `mlx_dllm_models.load` (which, while the float32-matmul CPU
   path of issue #28 is in the tree, turns it on: the row says), a prompt of random ordinary ids,
   the family's default settings (only max_tokens fixed, see MAX_TOKENS), the engine's decoder
   run for the prefill and --steps + 1 denoising steps. A spy on the model times each forward (its
   logits and the caches' K/V evaluated, after the engine's mask was), records its input width,
   head_span and logits shape. Reported: prefill seconds, the median step (from one denoising
   forward's call to the next one's) against the median bare forward of those steps, tokens
   committed per denoising forward in those steps, MLX's peak memory over the run (reset after
   load) against weights + the K/V the layout needs in theory (2 x layers x kv_heads x head_dim x
   bytes x (prompt + max_tokens), bytes of the activations' dtype) + one block's float32 logits,
   and the largest logits any forward returned (rows x vocabulary) against the full canvas.
5. mlx-vlm (LLaDA2.x, Nemotron), in a process of its own after generate (its JSON line apart, so
   that a run killed there, e.g. by the OOM killer on a shared machine, keeps the generation
   rows; `run --prompts` with no lengths measures this phase only): mlx-vlm's model built from
   the same config and given the same 4-bit arrays (no copy: the arrays are shared); one block
   decoded by each at temperature 0 with the same sampler, alternating runs: tok/s ratio and
   whether the tokens agree. mlx-vlm's layers are put on the same CPU matmul path as ours when
   ours is on it (cpu_layers' variants; its own QuantizedSwitchLinear is given ours' class), else
   a 4-bit matmul on this CPU would be compared with a float32 one.

Run with OpenBLAS preloaded (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3),
as the other benchmarks here: float32 matmuls are about 10x faster with it on this CPU.
Each phase appends a JSON line to <work>/results.jsonl; `run` deletes the checkpoint and its
conversion afterwards (--keep 4bit keeps the conversion for a later run that measures generation
only; --keep all keeps both). Run only one at a time on a shared machine.
"""

import argparse
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

GB = 1e9
SHARD_BYTES = 2 * 10**9
# A logit's standard deviation: the gap between a position's two best logits is then about
# HEAD_LOGIT_STD / sqrt(2 ln vocab) ~ 5 nats, so most predictions pass a 0.9-0.95 threshold, a
# block takes a few forwards (mlx-vlm's loops need steps = block_length to match ours), and ties
# near a threshold are rare.
HEAD_LOGIT_STD = 24.0
CHUNK = 1 << 25  # elements drawn at once (128 MB of float32)

# Qwen3-1.7B's dimensions (SDAR-1.7B-Chat is trained from it) over SDAR-8B-Chat's config.json: no
# copy of SDAR-1.7B-Chat's own config.json was found (find_files / find_string / code search for
# "SDAR-1.7B-Chat"); Qwen3-1.7B ties its embeddings (1.7B parameters only with the tie).
SDAR_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_window_layers=28,
    tie_word_embeddings=True,
)

CHECKPOINTS = {
    "sdar-1.7b": dict(data="JetLM__SDAR-8B-Chat", derive=SDAR_1_7B),
    "nemotron-3b": dict(data="nvidia__Nemotron-Labs-Diffusion-3B", fixture="nemotron", vlm=True),
    "llada2.0-mini": dict(data="inclusionAI__LLaDA2.0-mini", vlm=True),
    # 2.1-mini's index totals 9728 bytes more than 2.0-mini's with the same names: 19 MoE layers x
    # 256 experts x 2 bytes, its expert_bias stored in float32.
    "llada2.1-mini": dict(data="inclusionAI__LLaDA2.1-mini", vlm=True, float32=("expert_bias",)),
    "dream-7b": dict(data="Dream-org__Dream-v0-Instruct-7B"),
    "llada-8b": dict(data="GSAI-ML__LLaDA-8B-Instruct"),
    "nemotron-8b": dict(data="nvidia__Nemotron-Labs-Diffusion-8B", fixture="nemotron", vlm=True),
    "sdar-30b-a3b": dict(data="JetLM__SDAR-30B-A3B-Chat"),
    # A reconstructed config (tests/data/README.md); the names are its modeling code's, as
    # tests/fixtures/llada.py writes them.
    "llada-moe-7b-a1b": dict(data="inclusionAI__LLaDA-MoE-7B-A1B-Instruct", names="llada_moe"),
    "diffusiongemma-26b-a4b": dict(data="google__diffusiongemma-26B-A4B-it"),
}

# New tokens per run: one or two blocks of the family's default is enough for a few steps; the
# bidirectional families recompute prompt + max_tokens every step, so it sets their cost.
MAX_TOKENS = 64

HEADS = ("lm_head.weight", "diffusion_head.weight", "model.transformer.ff_out.weight")
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


# --------------------------------------------------------------------------------- checkpoint


def _read(name, filename):
    for path in (DATA / name / filename, DATA / name / (filename + ".gz")):
        if path.exists():
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as f:
                return json.load(f)
    return None


def real_config(key):
    entry = CHECKPOINTS[key]
    cfg = _read(entry["data"], "config.json")
    cfg.update(entry.get("derive", {}))
    return cfg


def _module(cfg):
    import importlib

    import mlx_dllm_models_hook  # noqa: F401
    from mlx_dllm_models.registry import MODEL_TYPES

    return importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[cfg['model_type']]}")


def lazy_model(cfg):
    """The family's model at the real config, never evaluated (MLX arrays are lazy)."""
    module = _module(cfg)
    return module, module.Model(module.ModelArgs.from_dict(cfg))


def _generalise(names, n_layers):
    """A fixture's weight names (a few layers) -> the same names over n_layers layers, layer 0's
    pattern repeated."""
    out = []
    for name in names:
        m = re.match(r"(.*\blayers\.)(\d+)(\..*)", name)
        if m is None:
            out.append(name)
        elif m[2] == "0":
            out += [f"{m[1]}{i}{m[3]}" for i in range(n_layers)]
    return out


def hf_names(key, cfg):
    """The checkpoint's weight names, and where they come from."""
    entry = CHECKPOINTS[key]
    index = _read(entry["data"], "model.safetensors.index.json")
    if index is not None:
        names = list(index["weight_map"])
        source = f"tests/data/{entry['data']}/model.safetensors.index.json"
        if "derive" in entry:
            n = cfg["num_hidden_layers"]
            names = [
                k
                for k in names
                if not re.search(r"\blayers\.(\d+)\.", k)
                or int(re.search(r"\blayers\.(\d+)\.", k)[1]) < n
            ]
            if cfg.get("tie_word_embeddings"):
                names = [k for k in names if k != "lm_head.weight"]
            source += f", cut to {n} layers" + (", tied head" if cfg["tie_word_embeddings"] else "")
        return names, source
    if entry.get("fixture") == "nemotron":
        from fixtures import nemotron as fx

        names = _generalise(fx.tensors(tied=cfg["tie_word_embeddings"]), cfg["num_hidden_layers"])
        return (
            names,
            "tests/fixtures/nemotron.py's names over the real layer count (no index found)",
        )
    if entry.get("names") == "llada_moe":
        from fixtures.llada import llada_moe_names

        return llada_moe_names(cfg), "LLaDA-MoE's modeling code's names (no index found)"
    raise SystemExit(f"{key}: no weight names (no index in tests/data, no fixture names)")


def hf_shapes(module, model, names):
    """name -> shape, from the shapes of the model's parameters that sanitize maps it onto;
    checked by running sanitize over lazy placeholders of those shapes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    rename = getattr(module, "_rename_olmo", lambda k: k)
    shapes = {}
    for name in names:
        shape = None
        for k in (name, rename(name)):
            if k in expected:
                shape = expected[k]
        m = re.match(r"(.*)\.experts\.\d+\.(\w+)\.weight$", name)
        if shape is None and m and f"{m[1]}.switch_mlp.{m[2]}.weight" in expected:
            shape = expected[f"{m[1]}.switch_mlp.{m[2]}.weight"][1:]
        if shape is None and name.endswith("mlp.gate.weight"):
            shape = expected.get(f"{name[:-6]}gate_proj.weight")
        if shape is None:
            raise SystemExit(f"no shape for {name}: add a rule")
        shapes[name] = shape
    out = model.sanitize({n: mx.zeros(s, dtype=mx.bfloat16) for n, s in shapes.items()})
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != expected:
        missing, extra = set(expected) - set(got), set(got) - set(expected)
        wrong = [k for k in set(got) & set(expected) if got[k] != expected[k]]
        raise SystemExit(
            f"sanitize check: missing {sorted(missing)[:4]} extra {sorted(extra)[:4]} "
            f"wrong {wrong[:4]}"
        )
    return shapes


def _draw(name, shape, hidden, dtype, mask_id=None):
    """One tensor's random bfloat16 value (drawn in chunks of rows, so the float32 draw of a
    large table is never whole)."""
    import mlx.core as mx

    base = name.rsplit(".", 1)[-1]
    if len(shape) == 1 or base in ("layer_scalar",):
        if base == "bias" or base.endswith("bias") or base == "expert_bias":
            return mx.zeros(shape, dtype=dtype)
        return mx.ones(shape, dtype=dtype)  # norms, scalars
    if name in HEADS:
        std = HEAD_LOGIT_STD / math.sqrt(hidden)
    elif name.endswith(EMBEDDINGS):
        std = 1.0
    else:
        std = 1.0 / math.sqrt(shape[-1])
    half = std * math.sqrt(3.0)
    rows = max(1, CHUNK // max(1, math.prod(shape[1:])))
    parts = []
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        p = mx.random.uniform(-half, half, (n,) + tuple(shape[1:])).astype(dtype)
        mx.eval(p)
        parts.append(p)
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if name.endswith(EMBEDDINGS) and mask_id is not None and mask_id < shape[0]:
        # As the fixtures: a mask's embedding carries little, so the context decides what a
        # masked position becomes (with a tied head, a full-size mask row would make every masked
        # position predict the mask itself, which decoding never proposes).
        out[mask_id] = out[mask_id] * 0.05
    mx.eval(out)
    return out


def write_checkpoint(key, path):
    """The random checkpoint of `key` at `path`, one tensor at a time, shards of ~2 GB."""
    import mlx.core as mx

    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = real_config(key)
    module, model = lazy_model(cfg)
    names, source = hf_names(key, cfg)
    shapes = hf_shapes(module, model, names)
    mask_id = model.diffusion_spec.mask_token_id
    del model
    hidden = cfg.get("hidden_size") or cfg.get("d_model")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = _read(CHECKPOINTS[key]["data"], "generation_config.json")
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    # Shards planned from the shapes, in the index's order, ~SHARD_BYTES each.
    shards, size = [[]], 0
    for name in names:
        nbytes = 2 * math.prod(shapes[name])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    wide = CHECKPOINTS[key].get("float32", ())
    mx.random.seed(0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            dtype = mx.float32 if name.endswith(wide) and wide else mx.bfloat16
            tensors[name] = _draw(name, shapes[name], hidden, dtype, mask_id)
            total += tensors[name].nbytes
            weight_map[name] = fname
        mx.save_safetensors(str(path / fname), tensors, metadata={"format": "pt"})
        del tensors
        mx.clear_cache()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    special = write_tokenizer(key, cfg, path)
    real_index = _read(CHECKPOINTS[key]["data"], "model.safetensors.index.json")
    return dict(
        names_from=source,
        tensors=len(names),
        shards=len(shards),
        bytes=total,
        real_index_total=None if real_index is None else real_index["metadata"]["total_size"],
        special_tokens=special,
        seconds=time.perf_counter() - t0,
    )


def _token_name(value):
    return value["content"] if isinstance(value, dict) else value


def write_tokenizer(key, cfg, path):
    """A byte-level tokenizer with the checkpoint's special tokens at their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mlx_dllm_models.tiny import _bytes_to_unicode

    entry = CHECKPOINTS[key]
    tok_cfg = _read(entry["data"], "tokenizer_config.json") or {}
    smap = _read(entry["data"], "special_tokens_map.json") or {}
    added = _read(entry["data"], "added_tokens.json") or {}
    special = {v["content"]: int(k) for k, v in tok_cfg.get("added_tokens_decoder", {}).items()}
    special.update({k: int(v) for k, v in added.items()})
    module, model = lazy_model(cfg)
    spec = model.diffusion_spec
    roles = {}
    for role in ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token"):
        value = smap.get(role, tok_cfg.get(role))
        if value is not None:
            roles[role] = _token_name(value)
    ids = dict(
        mask_token=spec.mask_token_id,
        eos_token=(list(spec.eos_token_ids) or [None])[0],
        bos_token=cfg.get("bos_token_id"),
        pad_token=cfg.get("pad_token_id"),
    )
    for role, idx in ids.items():
        if idx is None:
            continue
        if role not in roles:
            roles[role] = {"mask_token": "<|mask|>", "eos_token": "</s>"}.get(role, f"<|{role}|>")
        name = roles[role]
        if name not in special and idx not in special.values():
            special[name] = int(idx)
    vocab_size = cfg.get("vocab_size") or cfg.get("embedding_size")
    vocab_size = vocab_size or cfg.get("text_config", {}).get("vocab_size")
    taken = set(special.values())
    table = _bytes_to_unicode()
    vocab, free = {}, (i for i in range(vocab_size) if i not in taken)
    for b in range(256):
        vocab[table[b]] = next(free)
    vocab.update(special)
    for i in free:
        vocab[f"<|reserved_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(sorted(special, key=special.get))
    kw = {r: n for r, n in roles.items() if n in special}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    if tok_cfg.get("chat_template"):
        fast.chat_template = tok_cfg["chat_template"]
    fast.save_pretrained(str(path))
    return {r: special[n] for r, n in kw.items()}


# ------------------------------------------------------------------------------------ phases


def _rss():
    """(current, peak) resident set of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _du(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _weights(path):
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def phase_write(key, path):
    info = write_checkpoint(key, path)
    info.update(phase="write", rss_peak=_rss()[1], disk=_du(path))
    return info


def phase_convert(ckpt, out):
    """`python -m mlx_lm convert -q` in a child process; its own peak RSS from wait4."""
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "convert",
        "--hf-path",
        str(ckpt),
        "--mlx-path",
        str(out),
        "-q",
    ]
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{output[-3000:]}")
    shard = max(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    return dict(
        phase="convert",
        seconds=time.perf_counter() - tic,
        rss_peak=usage.ru_maxrss * 1024,
        input_bytes=_weights(ckpt),
        largest_input_shard=shard,
        output_bytes=_weights(out),
        output_disk=_du(out),
        output_tail=output[-400:],
    )


def phase_load(out):
    """Plain mlx_lm.load in this (fresh) process."""
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.utils
    from mlx.utils import tree_flatten

    # The tokenizer (a 150-260k entry vocabulary) is loaded after the model: its RSS is recorded
    # apart, as part of the fixed allowance.
    marks = {}
    real = mlx_lm.utils.load_tokenizer

    def load_tokenizer(*a, **k):
        marks["model"] = _rss()
        tok = real(*a, **k)
        marks["tokenizer"] = _rss()
        return tok

    mlx_lm.utils.load_tokenizer = load_tokenizer
    base = _rss()[0]
    tic = time.perf_counter()
    model, _ = mlx_lm.load(str(out))
    seconds = time.perf_counter() - tic
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rss, peak = _rss()
    tok_delta = marks["tokenizer"][0] - marks["model"][0]
    return dict(
        phase="load",
        seconds=seconds,
        rss_before=base,
        rss_model=marks["model"][0],
        rss_peak_model=marks["model"][1],
        tokenizer_rss=tok_delta,
        rss_after=rss,
        rss_peak=peak,
        model_ratio=(marks["model"][1] - base) / weights,
        mlx_peak=mx.get_peak_memory(),
        mlx_active=mx.get_active_memory(),
        weight_bytes=weights,
        ratio=(peak - base - tok_delta) / weights,
    )


def _kv_dims(model):
    """(layers, kv_heads, head_dim) the K/V of every layer take."""
    a = model.args
    kv = getattr(a, "num_key_value_heads", None) or getattr(a, "n_kv_heads", None)
    heads = getattr(a, "num_attention_heads", None) or getattr(a, "n_heads", None)
    hidden = getattr(a, "hidden_size", None) or getattr(a, "d_model", None)
    head_dim = getattr(a, "head_dim", None) or hidden // heads
    return len(model.layers), kv, head_dim


def _vocab(model):
    a = model.args
    return getattr(a, "embedding_size", None) or getattr(a, "vocab_size")


def random_prompt(model, rng, n):
    """n random ordinary ids (no special token; above mlx-vlm's pad ids)."""
    spec = model.diffusion_spec
    specials = set(spec.eos_token_ids) | {spec.mask_token_id}
    vocab = _vocab(model)
    low, high = (1000, 30000) if vocab > 40000 else (10, min(250, vocab))
    out = []
    while len(out) < n:
        t = int(rng.integers(low, high))
        if t not in specials:
            out.append(t)
    return out


class Spy:
    """Times each forward the engine issues: its logits and the caches' K/V evaluated."""

    def __init__(self, model):
        import mlx.core as mx

        self.calls = []
        self.outside = 0  # MLX's peak between forwards (the engine's own arrays)
        self.cls = type(model)
        real = self.cls.__call__
        self.real = real
        spy = self

        def timed(self, inputs, cache=None, mask=None, head_span=None):
            if isinstance(mask, mx.array):
                mx.eval(mask)
            spy.outside = max(spy.outside, mx.get_peak_memory())
            mx.reset_peak_memory()
            tic = time.perf_counter()
            out = real(self, inputs, cache=cache, mask=mask, head_span=head_span)
            kv = []
            for c in cache if isinstance(cache, (list, tuple)) else []:
                kv += [getattr(c, n) for n in ("keys", "values") if getattr(c, n, None) is not None]
            mx.eval(out, kv)
            bare = time.perf_counter() - tic
            peak = mx.get_peak_memory()
            mx.reset_peak_memory()
            spy.calls.append(
                dict(
                    at=tic,
                    bare=bare,
                    peak=peak,
                    width=inputs.shape[1],
                    rows=inputs.shape[0],
                    logits=tuple(out.shape),
                    head_span=head_span,
                )
            )
            return out

        self.cls.__call__ = timed

    def close(self):
        self.cls.__call__ = self.real


def decode_steps(model, tok, prompt, settings, steps):
    """The engine's decoder over `prompt` until steps + 1 denoising steps are done: per step its
    forward (the spy's record), and the committed count after each step."""
    import mlx.core as mx

    from mlx_dllm_models.engine.base import StepEvent
    from mlx_dllm_models.generate import stream_events

    s, ids, decoder = stream_events(model, tok, [prompt], **settings)
    mask = model.diffusion_spec.mask_token_id
    spy = Spy(model)
    step_at, canvases = [], []
    tic = time.perf_counter()
    try:
        for event in decoder.run(ids):
            if isinstance(event, StepEvent):
                step_at.append(len(spy.calls) - 1)
                canvases.append(event.generated)
                if len(step_at) > steps:
                    break
    finally:
        spy.close()
    wall = time.perf_counter() - tic
    outside = max(spy.outside, mx.get_peak_memory())
    calls = spy.calls
    first = step_at[0]
    prefill = calls[:first]
    fwd = [calls[i] for i in step_at]
    step_s = [b["at"] - a["at"] for a, b in zip(fwd, fwd[1:])]
    bare = [c["bare"] for c in fwd[:-1]]
    committed = [int((c != mask).sum().item()) for c in canvases]
    return dict(
        settings={k: v for k, v in s.items() if isinstance(v, (int, float, str, bool, type(None)))},
        prompt_ids=len(ids[0]),
        prefill_s=sum(c["bare"] for c in prefill),
        prefill_forwards=len(prefill),
        prefill_peak=max((c["peak"] for c in prefill), default=0),
        step_peak=max(c["peak"] for c in fwd),
        outside_peak=outside,
        peak=max([outside] + [c["peak"] for c in calls]),
        steps=len(step_s),
        step_s=statistics.median(step_s),
        bare_s=statistics.median(bare),
        step_over_bare=statistics.median(step_s) / statistics.median(bare),
        step_widths=sorted({c["width"] for c in fwd}),
        tokens_per_forward=committed[-2] / len(step_s) if len(step_s) else None,
        committed=committed,
        max_logit_rows=max(c["logits"][1] for c in calls),
        logits_shapes=sorted({c["logits"] for c in calls}),
        head_spans=sorted({str(c["head_span"]) for c in calls}),
        tokens=[int(t) for t in mx.array(canvases[-1]).reshape(-1).tolist()],
        wall=wall,
    )


def _load_ours(out):
    """mlx_dllm_models.load, and how many layers it put on the CPU's float32-matmul path with
    what one forward then holds widened."""
    from mlx_dllm_models import load

    model, tok = load(str(out))
    try:
        from mlx_dllm_models.models import cpu_layers

        swapped = sum(type(m) in cpu_layers.PARENTS for _, m in model.named_modules())
        widened = cpu_layers.widened_bytes(model) if swapped else 0
    except ImportError:
        swapped, widened = None, 0
    return model, tok, swapped, widened


def phase_generate(out, key, prompts, steps):
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    base = _rss()[0]
    model, tok, swapped, widened = _load_ours(out)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    layers, kv_heads, head_dim = _kv_dims(model)
    vocab = _vocab(model)
    act_bytes = 4 if swapped else 2
    rng = np.random.default_rng(0)
    rows = []
    for n in prompts:
        prompt = random_prompt(model, rng, n)
        settings = dict(max_tokens=MAX_TOKENS, temperature=0)
        mx.clear_cache()
        mx.reset_peak_memory()
        r = decode_steps(model, tok, prompt, settings, steps)
        peak = r["peak"]
        block = r["settings"].get("block_length") or MAX_TOKENS
        tokens = r["prompt_ids"] + MAX_TOKENS
        kv = 2 * layers * kv_heads * head_dim * act_bytes * tokens
        logits = block * vocab * 4
        theory = weights + kv + logits
        r.update(
            prompt=n,
            peak=peak,
            theory=theory,
            kv_theory=kv,
            logits_theory=logits,
            peak_over_theory=peak / theory,
            peak_over_theory_and_widening=peak / (theory + widened),
            canvas=tokens,
            full_canvas_logits=r["max_logit_rows"] >= tokens,
        )
        r.pop("tokens")
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    result = dict(
        phase="generate",
        key=key,
        cpu_float32_matmuls=swapped,
        widened_bytes=widened,
        weight_bytes=weights,
        kv_dims=(layers, kv_heads, head_dim),
        act_bytes=act_bytes,
        vocab=vocab,
        rss_before=base,
        rss_peak=_rss()[1],
        rows=rows,
    )
    return result


def phase_vlm(out, key, pairs):
    model, tok, swapped, _ = _load_ours(out)
    result = versus_vlm(model, tok, out, pairs, bool(swapped))
    return dict(phase="vlm", key=key, rss_peak=_rss()[1], **result)


# --------------------------------------------------------------------------------- mlx-vlm


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


# ------------------------------------------------------------------------------------ driver


def _child(args, log):
    """This script's phase in a fresh interpreter; its JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *map(str, args)]
    env = dict(os.environ)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"phase {args[0]} failed ({proc.returncode})")
    line = proc.stdout.decode().strip().splitlines()[-1]
    with open(log, "a") as f:
        f.write(line + "\n")
    return json.loads(line)


def run(key, work, prompts, steps, vlm_pairs, keep="none"):
    """keep: "none" (delete both folders at the end), "4bit" (keep the conversion: a later run
    with the same work folder reuses it and measures generation only), "all"."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out = work / f"{key}-hf", work / f"{key}-4bit"
    log = work / "results.jsonl"
    load = os.getloadavg()
    with open(log, "a") as f:
        f.write(json.dumps(dict(phase="start", key=key, loadavg=load, at=time.time())) + "\n")
    reuse = (out / "config.json").exists() and keep != "none"
    try:
        if not reuse:
            _child(["_write", key, ckpt], log)
            if out.exists():
                shutil.rmtree(out)
            _child(["_convert", ckpt, out], log)
            if keep != "all":
                shutil.rmtree(ckpt)
            _child(["_load", out], log)
        if prompts:
            _child(["_generate", out, key, "--steps", steps, "--prompts", *prompts], log)
        if vlm_pairs and CHECKPOINTS[key].get("vlm"):
            _child(["_vlm", out, key, "--pairs", vlm_pairs], log)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps(dict(phase="end", key=key, loadavg=os.getloadavg())) + "\n")
        for p, kept in ((ckpt, keep == "all"), (out, keep != "none")):
            if p.exists() and not kept:
                shutil.rmtree(p)


def _records(files):
    """key -> {phase: record} from results files (the last record of each phase wins)."""
    out, key = {}, None
    for f in files:
        for line in Path(f).read_text().splitlines():
            d = json.loads(line)
            if d["phase"] == "start":
                key = d["key"]
            rec = out.setdefault(key, {})
            if d["phase"] == "generate" and "generate" in rec:
                # Rows of several runs: one per prompt length, the later run's where both have it.
                rows = {r["prompt"]: r for r in rec["generate"]["rows"] + d["rows"]}
                d = dict(d, rows=sorted(rows.values(), key=lambda r: r["prompt"]))
                d.setdefault("vlm", rec["generate"].get("vlm"))
            if d["phase"] in ("start", "end"):
                rec.setdefault("loadavg", []).append(d["loadavg"][0])
            rec[d["phase"]] = d
    return out


def table(files):
    """The markdown tables of BENCHMARKS.md from results files."""
    g = GB
    recs = _records(files)
    print(
        "| checkpoint | HF bf16 GB (shards) | 4-bit GB | convert s | convert peak RSS GB "
        "(largest shard) | load: peak RSS - base - tokenizer GB / weights GB "
        "| load average (1 min, at starts and ends) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for key, r in recs.items():
        w, c, lo = r.get("write"), r.get("convert"), r.get("load")
        if not (w and c and lo):
            continue
        extra = lo["rss_peak"] - lo["rss_before"] - lo["tokenizer_rss"]
        print(
            f"| {key} | {w['bytes'] / g:.2f} ({w['shards']}) | {c['output_bytes'] / g:.2f} "
            f"| {c['seconds']:.0f} | {c['rss_peak'] / g:.2f} ({c['largest_input_shard'] / g:.2f}) "
            f"| {extra / g:.2f} / {lo['weight_bytes'] / g:.2f} = {lo['ratio']:.3f} "
            f"| {', '.join(f'{x:.1f}' for x in r['loadavg'])} |"
        )
    print()
    print(
        "| checkpoint | prompt | settings | prefill s (s / token) | step s | bare forward s "
        "| ratio | tokens / forward | MLX peak GB | theory GB (K/V) | peak / theory "
        "| + widening | largest logits rows / canvas |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in recs.items():
        gen = r.get("generate")
        if not gen:
            continue
        for row in gen["rows"]:
            st = row["settings"]
            label = st.get("sampler")
            if label in ("threshold", "llada2"):
                label += f" {st['threshold']}"
            if st.get("alg"):
                label += f" ({st['alg']})"
            label += f", block {st['block_length']}, {st['steps']} steps, cache {st.get('cache')}"
            prefill = "none (full recompute)"
            if row["prefill_forwards"]:
                prefill = f"{row['prefill_s']:.0f} ({row['prefill_s'] / row['prompt']:.3f})"
            print(
                f"| {key} | {row['prompt']} | {label} | {prefill} | {row['step_s']:.2f} "
                f"| {row['bare_s']:.2f} | {row['step_over_bare']:.3f} "
                f"| {row['tokens_per_forward']:.2f} | {row['peak'] / g:.2f} "
                f"| {row['theory'] / g:.2f} ({row['kv_theory'] / g:.2f}) "
                f"| {row['peak_over_theory']:.2f} | {row['peak_over_theory_and_widening']:.2f} "
                f"| {row['max_logit_rows']} / {row['canvas']} |"
            )
    print()
    print(
        "| checkpoint | settings | prompt | forwards ours / mlx-vlm | s ours / mlx-vlm "
        "| tok/s ratio | tokens equal |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for key, r in recs.items():
        # Older results files carry it inside the generate record.
        v = r.get("vlm") or (r.get("generate") or {}).get("vlm")
        if not v:
            continue
        print(
            f"| {key} | {v['settings']} | {v['prompt']} | {v['ours_nfe']} / "
            f"{v.get('vlm_forwards', '?')} | {v['ours_s']:.1f} / {v['vlm_s']:.1f} "
            f"| {v['tok_s_ratio']:.2f} | {'yes' if v['tokens_equal'] else 'no'} |"
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("key", choices=CHECKPOINTS)
    r.add_argument("--work", default="/tmp/bench_real_shapes")
    # No lengths: no generate phase (with --keep 4bit, the mlx-vlm side-by-side alone).
    r.add_argument("--prompts", nargs="*", type=int, default=[512])
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--vlm-pairs", type=int, default=2)
    r.add_argument("--keep", choices=("none", "4bit", "all"), default="none")
    w = sub.add_parser("write")
    w.add_argument("key", choices=CHECKPOINTS)
    w.add_argument("path")
    sub.add_parser("list")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    p = sub.add_parser("_write")
    p.add_argument("key")
    p.add_argument("path")
    p = sub.add_parser("_convert")
    p.add_argument("ckpt")
    p.add_argument("out")
    p = sub.add_parser("_load")
    p.add_argument("out")
    p = sub.add_parser("_generate")
    p.add_argument("out")
    p.add_argument("key")
    p.add_argument("--prompts", nargs="+", type=int, default=[512])
    p.add_argument("--steps", type=int, default=3)
    p = sub.add_parser("_vlm")
    p.add_argument("out")
    p.add_argument("key")
    p.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()

    if args.cmd == "list":
        for key, entry in CHECKPOINTS.items():
            print(key, entry["data"], "derived" if "derive" in entry else "")
        return
    if args.cmd == "table":
        table(args.files)
        return
    if args.cmd == "run":
        run(args.key, args.work, args.prompts, args.steps, args.vlm_pairs, args.keep)
        return
    if args.cmd == "write":
        print(json.dumps(write_checkpoint(args.key, args.path)))
        return
    if args.cmd == "_write":
        res = phase_write(args.key, args.path)
    elif args.cmd == "_convert":
        res = phase_convert(args.ckpt, args.out)
    elif args.cmd == "_load":
        res = phase_load(args.out)
    elif args.cmd == "_generate":
        res = phase_generate(args.out, args.key, args.prompts, args.steps)
    else:
        res = phase_vlm(args.out, args.key, args.pairs)
    print(json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
