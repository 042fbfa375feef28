"""Every family at its real width (issue #25 §4): what a tiny fixture cannot show.

Each checkpoint is a real config.json of tests/data (hidden size, vocabulary, heads and K/V heads,
head_dim, experts and routing groups, RoPE and its scaling, canvas length, special ids: all as
published) with one or two layers and narrow MLPs (the MLP widths are the one thing shrunk: they
are not what differs between a fixture and a real checkpoint, and at full width they would be most
of the bytes). It is written in the Hugging Face layout with random bfloat16 weights, as the
checkpoints are published (names from the real weight index where one was found), then converted
by mlx-lm's convert and loaded by this package's `load`, as a user does. On it:

* the logits of a prompt and a block of masks (a canvas for DiffusionGemma) against the family's
  reference forward on the same weights in float32 (transformers, or mlx-vlm where README's family
  table names it), within 1e-4 of the reference's largest logit;
* a short generation, whose forwards never compute logits over more than one block (a canvas) of
  positions, and whose peak memory stays within 1.2 x (the weights + the K/V the layout needs in
  theory + one block's float32 logits).

The output heads are scaled so that predictions are confident, and the mask token's embedding is
small, as in the fixtures (tests/real_width_checkpoints.py writes those checkpoints). LLaDA-MoE's
config is a reconstruction from quotes (tests/data/README.md).

They run in CI: 190-260 s for the eight on two CPU cores (mostly writing, converting and reading
1.5-3 GB of weights per family; a forward over one block of a 126k x 4,096 head takes seconds on
MLX's CPU backend). pytest-xdist keeps them on one worker, one at a time (the `xdist_group` below,
with `--dist loadgroup` in pyproject.toml): each peaks at 3-12 GB of RSS with its reference, two
at once beside the rest of the suite would crowd CI's memory. Each deletes its checkpoints when it
ends (pytest keeps its last three runs' temporary folders: 7-14 GB a run otherwise).
"""

import contextlib
import gc
import json
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fixtures.llada import llada_moe_names
from helpers import parity
from mlx_dllm_models.models.cpu_layers import on_cpu, widened_bytes
from real_checkpoints import DATA, hf_shape, model_module
from real_width_checkpoints import (
    config_with,
    from_index,
    from_model,
    mlx_shapes,
    random_tensors,
    write_checkpoint,
)

pytestmark = [pytest.mark.xdist_group("real_width"), pytest.mark.slow]

GB = 1e9
# The MLP widths the real-width checkpoints get (expert, shared-expert and dense MLPs alike).
NARROW = 64


# ------------------------------------------------------------------------------ references


def _torch_model(cls, cfg, state):
    """A transformers model built on the meta device and given `state` in float32."""
    import torch

    with torch.device("meta"):
        model = cls(cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    # Buffers (RoPE's inverse frequencies) are not in the state: their modules are built again.
    for parent in list(model.modules()):
        for child_name, child in parent.named_children():
            if any(b.is_meta for b in child.buffers(recurse=False)):
                setattr(parent, child_name, type(child)(config=cfg))
    return model.eval()


def _hf_state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _torch_logits(model, ids, keep=None):
    """float32 logits of a transformers model under a boolean keep mask (None: every key)."""
    import torch

    x = torch.as_tensor(np.asarray(ids)).long()
    L = x.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool) if keep is None else torch.as_tensor(keep)
    mask = torch.zeros(1, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=x, attention_mask=mask, use_cache=False).logits.float().numpy()


def _llada_reference(path, config, ids, spec):
    """transformers' Llama under a bidirectional mask (LLaDA's blocks are Llama's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rename = getattr(model_module(config), "_rename_olmo")  # OLMo names -> Llama's (mlx-lm's too)
    state = {rename(k): v for k, v in _hf_state(path).items()}
    cfg = LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["d_model"],
        intermediate_size=config["mlp_hidden_size"],
        num_hidden_layers=config["n_layers"],
        num_attention_heads=config["n_heads"],
        num_key_value_heads=config["n_kv_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        max_position_embeddings=config["max_sequence_length"],
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return _torch_logits(_torch_model(LlamaForCausalLM, cfg, state), ids)


def _llada_moe_reference(path, config, ids, spec):
    """transformers' Qwen3-MoE without top-k renormalisation (tests/reference/llada_torch.py),
    under a bidirectional mask."""
    from reference.llada_torch import qwen3_moe

    weights = {k: v.float().numpy() for k, v in _hf_state(path).items()}
    model, context = qwen3_moe(config, weights)
    del weights
    with context():
        return _torch_logits(model, ids)


def _dream_reference(path, config, ids, spec):
    """transformers' Qwen2 under a bidirectional mask; logits unshifted, as the model returns."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    keys = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads rms_norm_eps max_position_embeddings"
    ).split()
    cfg = Qwen2Config(
        **{k: config[k] for k in keys},
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        tie_word_embeddings=False,
        use_sliding_window=False,
        attn_implementation="eager",
    )
    return _torch_logits(_torch_model(Qwen2ForCausalLM, cfg, _hf_state(path)), ids)


def _sdar_reference(path, config, ids, spec):
    """transformers' Qwen3 / Qwen3-MoE (tests/reference/sdar_torch.py) under the block-causal mask
    of the trained block size."""
    from reference.sdar_torch import load_reference, reference_logits

    try:
        return reference_logits(path, ids, spec.trained_block_length)
    finally:
        load_reference.cache_clear()


def _llada2_reference(path, config, ids, spec):
    """mlx-vlm's llada2_moe (the HF router) in float32 under the block-causal mask."""
    from mlx_vlm.models.llada2_moe import Model
    from mlx_vlm.models.llada2_moe.config import ModelConfig

    from mlx_dllm_models.masks import block_causal_mask

    model = Model(ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    model.set_dtype(mx.float32)
    mask = block_causal_mask(ids.shape[1], spec.trained_block_length)
    return np.array(model.language_model(mx.array(ids), mask=mask).logits.astype(mx.float32))


def _nemotron_reference(path, config, ids, spec):
    """mlx-vlm's Nemotron-Labs-Diffusion in float32, bidirectional (its diffusion mode)."""
    from fixtures.nemotron import mlx_vlm_model

    model = mlx_vlm_model(path)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(ids), use_causal_mask=False).logits.astype(mx.float32))


# ------------------------------------------------------------------------------ the families

# The block (canvas) every parity forward and generation uses: a prompt of PROMPT tokens, BLOCK
# masks. Short: at these widths a CPU forward over one position of the head costs ~0.3 s.
PROMPT, BLOCK = 4, 8
HEAD = 24.0  # the output head's gain: confident predictions


def _llada(tmp):
    rename = getattr(model_module({"model_type": "llada"}), "_rename_olmo")
    roles = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", mask_token="<|mdm_mask|>")
    tokens = {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336}
    embed = ("model.transformer.wte.weight", "model.transformer.ff_out.weight")
    overrides = {"n_layers": 1, "mlp_hidden_size": NARROW}
    data = "GSAI-ML__LLaDA-8B-Instruct"
    return from_index(tmp, data, 1, overrides, embed, HEAD, tokens, roles, rename)


def _dream(tmp):
    roles = dict(eos_token="<|endoftext|>", mask_token="<|mask|>")
    tokens = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|mask|>": 151666}
    embed = ("model.embed_tokens.weight", "lm_head.weight")
    overrides = {"num_hidden_layers": 1, "intermediate_size": NARROW}
    return from_index(
        tmp, "Dream-org__Dream-v0-Instruct-7B", 1, overrides, embed, HEAD, tokens, roles
    )


def _sdar(data, moe):
    def build(tmp):
        roles = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", mask_token="<|MASK|>")
        tokens = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|MASK|>": 151669}
        embed = ("model.embed_tokens.weight", "lm_head.weight")
        width = {"moe_intermediate_size": NARROW} if moe else {"intermediate_size": NARROW}
        overrides = {"num_hidden_layers": 1, **width}
        return from_index(tmp, data, 1, overrides, embed, HEAD, tokens, roles)

    return build


def _llada_moe(tmp):
    """LLaDA-MoE's reconstructed config (no index was found: the names are its modeling code's,
    as the fixtures write them); every layer MoE, 64 experts of NARROW, top 8."""
    roles = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|mask|>")
    tokens = {"<|endoftext|>": 156892, "<|mask|>": 156895}
    embed = ("model.embed_tokens.weight", "lm_head.weight")
    overrides = {
        "num_hidden_layers": 1,
        "moe_layer_freq": [1],
        "dense_intermediate_size": NARROW,
        "expert_intermediate_size": NARROW,
    }
    config = config_with("inclusionAI__LLaDA-MoE-7B-A1B-Instruct", overrides)
    expected = mlx_shapes(config)
    shapes = {n: hf_shape(n, expected, lambda k: k) for n in llada_moe_names(config)}
    tensors = random_tensors(shapes, np.random.default_rng(0), HEAD, embed, 156895)
    return write_checkpoint(tmp / "hf", config, tensors, tokens, roles), config


def _llada2(tmp):
    roles = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|mask|>")
    tokens = {"<|endoftext|>": 156892, "<|mask|>": 156895}
    embed = ("model.word_embeddings.weight", "lm_head.weight")
    # Two layers: the first is dense (first_k_dense_replace 1), the second routes 8 of 256
    # experts in 8 groups (4 kept) with the sigmoid + expert-bias router and a shared expert.
    overrides = {
        "num_hidden_layers": 2,
        "intermediate_size": NARROW,
        "moe_intermediate_size": NARROW,
    }
    data = "inclusionAI__LLaDA2.0-mini"
    return from_index(tmp, data, 2, overrides, embed, HEAD, tokens, roles)


def _nemotron(tmp):
    # Its special ids (mask 100, EOS 11) lie among the bytes: the config's ids are what count.
    embed = ("encoder.embed_tokens.weight", "diffusion_head.weight")
    overrides = {"num_hidden_layers": 1, "intermediate_size": NARROW}
    data = "nvidia__Nemotron-Labs-Diffusion-3B"
    return from_model(tmp, data, overrides, embed, HEAD, {}, {})


def _diffusion_gemma(tmp):
    """Written by transformers' DiffusionGemmaForBlockDiffusion (its names, its tied copies),
    text-only: the real vision tower is not what this test is about (its weights and config are
    dropped from the checkpoint)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    config = config_with("google__diffusiongemma-26B-A4B-it", {})
    text = dict(config["text_config"])
    # One sliding-window layer and one full-attention layer (global head_dim 512, K = V).
    text.update(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        intermediate_size=NARROW,
        moe_intermediate_size=NARROW,
    )
    tiny_vision = dict(config["vision_config"], num_hidden_layers=1, hidden_size=16)
    tiny_vision.update(intermediate_size=16, num_attention_heads=1, num_key_value_heads=1)
    top = {
        k: config[k] for k in ("canvas_length", "boi_token_id", "eoi_token_id", "image_token_id")
    }
    hf_config = DiffusionGemmaConfig(text_config=text, vision_config=tiny_vision, **top)
    # Its parameters are all drawn below; its buffers (RoPE's frequencies, the embedding and layer
    # scalars) are transformers' own, taken from the same model at a 512-token vocabulary (none
    # depends on it): initialising the 262k x 2816 table as transformers does took 28 s here.
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(hf_config)
    model = model.to_empty(device="cpu").eval()
    model.tie_weights()  # to_empty unties the encoder's and decoder's shared weights
    small = dict(text, vocab_size=512)
    small = DiffusionGemmaConfig(text_config=small, vision_config=tiny_vision, **top)
    buffers = dict(DiffusionGemmaForBlockDiffusion(small).named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                gain = HEAD / 8 if "embed_tokens" in name else 1.0  # the tied head, softcapped
                p.uniform_(-1, 1, generator=gen).mul_(gain * 3**0.5 / p.shape[-1] ** 0.5)
    path = tmp / "hf"
    # float32, unlike the other families: DiffusionGemma rounds its scaled embeddings to the
    # weights' dtype (as transformers does), which a float32 reference would not.
    model.config.text_config.dtype = "float32"
    # Text only: the tower's weights and config go (its weights never written: 3 GB of float32
    # take 10 s to write here).
    text_state = {k: v for k, v in model.state_dict().items() if "vision" not in k}
    model.save_pretrained(str(path), state_dict=text_state)
    saved = json.loads((path / "config.json").read_text())
    saved.pop("vision_config", None)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    gen_config = json.loads(
        (DATA / "google__diffusiongemma-26B-A4B-it" / "generation_config.json").read_text()
    )
    (path / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    from mlx_dllm_models.tiny import build_tokenizer

    build_tokenizer(path, {})
    _DG_REFERENCE[str(path)] = model
    return path, saved


_DG_REFERENCE = {}


def _diffusion_gemma_reference(path, config, ids, spec):
    """transformers' DiffusionGemma: the prompt encoded, the canvas decoded (first step)."""
    import torch

    model = _DG_REFERENCE.pop(str(path))
    prompt, canvas = (torch.as_tensor(a).long() for a in np.split(ids, [PROMPT], axis=1))
    with torch.no_grad():
        return model(input_ids=prompt, decoder_input_ids=canvas).logits.float().numpy()


FAMILIES = {
    "llada": (_llada, _llada_reference),
    "dream": (_dream, _dream_reference),
    "sdar": (_sdar("JetLM__SDAR-8B-Chat", moe=False), _sdar_reference),
    "sdar_moe": (_sdar("JetLM__SDAR-30B-A3B-Chat", moe=True), _sdar_reference),
    "llada2_moe": (_llada2, _llada2_reference),
    "llada_moe": (_llada_moe, _llada_moe_reference),
    "nemotron_labs_diffusion": (_nemotron, _nemotron_reference),
    "diffusion_gemma": (_diffusion_gemma, _diffusion_gemma_reference),
}


# ------------------------------------------------------------------------------ the test


def _ids(spec, rng):
    """A prompt of PROMPT byte tokens, then a block of masks (uniform noise for DiffusionGemma)."""
    prompt = rng.integers(0, 256, size=PROMPT)
    if spec.mask_token_id is None:
        return np.concatenate([prompt, rng.integers(0, 256, size=BLOCK)])[None]
    return np.concatenate([prompt, np.full(BLOCK, spec.mask_token_id)])[None]


def _forward(model, spec, ids):
    """The parity forward: the whole sequence under the family's mask; DiffusionGemma encodes
    the prompt and decodes the canvas against its cache, as the engine does."""
    from mlx_dllm_models.spec import ENCODER_CANVAS

    x = mx.array(ids)
    if spec.attention == ENCODER_CANVAS:
        cache = model.make_cache()
        model.encode(x[:, :PROMPT], cache)
        return model.decode(x[:, PROMPT:], cache)
    return model(x, mask=_parity_mask(spec, ids.shape[1]))


@contextlib.contextmanager
def _logit_rows(model, rows):
    """Records the positions of every logits array the model returns (`__call__`, `decode`)."""
    cls = type(model)
    saved = {}
    for method in ("__call__", "decode"):
        if not hasattr(cls, method):
            continue
        saved[method] = cls.__dict__.get(method)
        original = getattr(cls, method)

        def spy(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            if self is model:
                rows.append(out.shape[1])
            return out

        setattr(cls, method, spy)
    try:
        yield
    finally:
        for method, own in saved.items():
            if own is None:
                delattr(cls, method)
            else:
                setattr(cls, method, own)


def _parity_mask(spec, length):
    from mlx_dllm_models.masks import block_causal_mask
    from mlx_dllm_models.spec import BLOCK_CAUSAL

    if spec.attention == BLOCK_CAUSAL:
        return block_causal_mask(length, spec.trained_block_length)
    return None


def _settings(spec):
    """A short generation: one block of BLOCK tokens (the trained block when it is shorter), in
    few steps where the family counts them."""
    from mlx_dllm_models.settings import SHARED_SETTINGS, family_settings
    from mlx_dllm_models.spec import BLOCK_CAUSAL

    names = SHARED_SETTINGS + family_settings(spec.family)
    settings = {"max_tokens": BLOCK}
    if "max_denoising_steps" in names:  # DiffusionGemma: a canvas of BLOCK, two steps
        return dict(
            settings, min_canvas_length=BLOCK, max_canvas_length=BLOCK, max_denoising_steps=2
        )
    if spec.attention == BLOCK_CAUSAL:  # blocks are the trained ones, aligned at 0, B, 2B, ...
        settings["block_length"] = spec.trained_block_length
    elif "block_length" in names:
        settings["block_length"] = BLOCK
    if "steps" in names:  # one step a block: as few forwards as the family allows
        settings["steps"] = max(1, BLOCK // settings.get("block_length", BLOCK))
    return settings


def _kv_bytes(model, tokens):
    """The K/V the layout needs in theory: 2 x layers x kv_heads x head_dim x bytes x tokens (the
    activations, and so the K/V, are float32 on the CPU)."""
    total = 0
    for layer in model.layers:
        attn = layer["self_attn"] if "self_attn" in layer else layer["attention"]
        if "k_proj" in attn:
            width = attn["k_proj"]["weight"].shape[0]
        else:  # LLaDA2's fused query_key_value
            width = attn.num_key_value_heads * attn.head_dim
        total += 2 * width * 4 * tokens
    return total


def _weight_bytes(model):
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.fixture
def work(tmp_path):
    """tmp_path, emptied when the test ends: the checkpoints are gigabytes."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_width(name, work):
    tmp_path = work
    from mlx_lm.convert import convert

    from mlx_dllm_models import generate_diffusion, load

    build, reference = FAMILIES[name]
    times = {}
    start = time.perf_counter()
    hf, config = build(tmp_path)
    times["write"] = time.perf_counter() - start
    convert(str(hf), str(tmp_path / "mlx"))
    times["convert"] = time.perf_counter() - start - sum(times.values())

    model, tokenizer = load(tmp_path / "mlx")
    spec = model.diffusion_spec
    ids = _ids(spec, np.random.default_rng(0))
    ours = _forward(model, spec, ids)
    if ours.dtype != mx.float32:  # half-precision compute (no float32 path here): in float32
        model.set_dtype(mx.float32)
        ours = _forward(model, spec, ids)
    ours = np.array(ours)
    del model
    gc.collect()
    times["ours"] = time.perf_counter() - start - sum(times.values())
    expected = reference(hf, config, ids, spec)
    gc.collect()
    times["reference"] = time.perf_counter() - start - sum(times.values())
    ok, err = parity(ours, expected)
    assert ok, f"{name}: max error {err:.3g}, max |logit| {np.abs(expected).max():.3g}"

    model, tokenizer = load(tmp_path / "mlx")
    settings = _settings(spec)
    rows = []
    prompt = [int(t) for t in ids[0, :PROMPT]]
    mx.eval(model.parameters())
    mx.reset_peak_memory()
    with _logit_rows(model, rows):
        generate_diffusion(model, tokenizer, prompt, **settings)
    peak = mx.get_peak_memory()
    times["generate"] = time.perf_counter() - start - sum(times.values())

    weights = _weight_bytes(model)
    kv = _kv_bytes(model, PROMPT + settings["max_tokens"])
    block = settings.get("block_length", settings["max_tokens"])
    logits = block * ours.shape[-1] * 4
    # On MLX's CPU backend, half-precision weights run through float32 matmuls that widen each
    # weight inside the forward (models/cpu_layers.py); MLX's scheduler allocates the outputs of
    # the ops it runs ahead to, so a forward holds up to one layer's widened weights and the widened
    # LM head on top of the weights (measured here: LLaDA-8B's head, 2.1 GB). That transient is
    # the CPU path's price, zero elsewhere; the rule holds on what remains.
    widened = widened_bytes(model) if on_cpu() else 0
    bound = 1.2 * (weights + kv + logits) + widened
    print(
        f"{name}: weights {weights / GB:.2f} GB, K/V {kv / 1e6:.1f} MB, block logits "
        f"{logits / 1e6:.1f} MB, CPU widening {widened / GB:.2f} GB, peak {peak / GB:.2f} GB "
        f"(bound {bound / GB:.2f}); "
        + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
        + f"; {len(rows)} forwards, head rows {rows}"
    )
    # No forward computes the head over more than one block of positions.
    assert rows and max(rows) <= block, rows
    assert peak <= bound, f"{name}: peak {peak / GB:.2f} GB over {bound / GB:.2f} GB"
