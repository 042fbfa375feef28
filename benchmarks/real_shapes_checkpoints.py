"""The random-weight checkpoints of benchmarks/bench_real_shapes.py: each size's published config
(tests/data), its real weight names and the shapes the family's lazily built model gives them,
random bfloat16 values written one tensor at a time into ~2 GB shards, and a byte-level tokenizer
holding the checkpoint's special tokens at their real ids (that script's docstring says how)."""

import gzip
import json
import math
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"

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

HEADS = ("lm_head.weight", "diffusion_head.weight", "model.transformer.ff_out.weight")
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


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

    from mlx_dllm_models.byte_level import bytes_to_unicode

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
    table = bytes_to_unicode()
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
