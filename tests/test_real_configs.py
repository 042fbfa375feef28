"""The package against the real configuration files of real checkpoints (tests/data, see its README).

For each checkpoint whose files were found: its config.json resolves to the family's ModelArgs and
DiffusionSpec (mask id, EOS ids, trained block size, RoPE, MoE routing); the model builds at its real
size without allocating weights (MLX arrays are lazy and nothing here evaluates them); `sanitize`
maps the real weight-name set of model.safetensors.index.json exactly onto the model's parameters;
the tokenizer files give the special tokens the ids the spec uses. The decoding settings resolved
from the same files are tests/test_real_recommended_settings.py's.

Some files are transcriptions (tests/data/README.md says which): Nemotron-Labs-Diffusion's and
DiffusionGemma's configs were quoted in ports' tests and a model-card walkthrough, never found as a
byte copy, and no weight index or tokenizer file of theirs was found: those tests skip, saying so.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_dllm_models.registry import MODEL_TYPES
from mlx_dllm_models.request import eos_ids
from real_checkpoints import (
    NOT_FOUND,
    build,
    built,
    hf_shape,
    load_json,
    model_module,
    require,
)

MB = 1 << 20


def _rope_of(model):
    layer = model.layers[0]
    attn = layer["self_attn"] if "self_attn" in layer else layer["attention"]
    return attn.rope


def _check_llada(name, model, args, spec):
    assert not args.is_moe
    assert (args.d_model, args.n_layers, args.n_heads, args.n_kv_heads) == (4096, 32, 32, 32)
    assert args.mlp_hidden_size == 12288 and args.vocab_size == 126464
    assert args.tie_word_embeddings is False
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 500000.0, False)


def _check_llada_moe(name, model, args, spec):
    """A reconstruction from quotes (tests/data/README.md): 7.36e9 parameters, 64 experts of
    1024, top 8, every layer MoE, no shared expert, full rotary."""
    assert args.is_moe and (args.hidden_size, args.num_hidden_layers) == (2048, 16)
    assert (args.num_experts, args.num_experts_per_tok, args.expert_intermediate_size) == (
        64,
        8,
        1024,
    )
    assert args.vocab_size == 157184 and args.shared_expert_intermediate_size is None
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 50000.0, False)


def _check_dream(name, model, args, spec):
    assert (args.hidden_size, args.num_hidden_layers, args.num_key_value_heads) == (3584, 28, 4)
    assert args.tie_word_embeddings is False and args.rope_scaling is None
    assert spec.logit_shift == 1
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 1000000.0, False)


def _check_sdar(name, model, args, spec):
    assert (args.hidden_size, args.num_hidden_layers, args.head_dim) == (4096, 36, 128)
    assert args.rope_scaling is None and args.tie_word_embeddings is False
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 1000000.0, False)


def _check_sdar_v(name, model, args, spec):
    """SDAR-VL 4B: SDAR-4B's text model, SigLIP-so400m (27 layers, features of the last), anyres
    over 6 x 6 tiles of 384 (anyres_max_9), image newline."""
    text = args.text
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (2560, 36, 128)
    assert text.tie_word_embeddings is False and args.image_token_index == 151655
    assert len(args.image_grid_pinpoints) == 36 and args.vision_aspect_ratio == "anyres_max_9"
    assert len(model.vision_tower.vision_model.encoder.layers) == 27
    assert model.image_newline.shape == (2560,)
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 1000000.0, False)


def _check_sdar_moe(name, model, args, spec):
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (128, 8, 768)
    assert (
        args.norm_topk_prob is True and args.decoder_sparse_step == 1 and args.mlp_only_layers == []
    )
    # Every one of the 48 layers is a MoE layer (decoder_sparse_step 1, no mlp_only_layers).
    assert len(model.layers) == 48
    for layer in model.layers:
        mlp = layer.mlp
        assert "switch_mlp" in mlp and mlp.top_k == 8 and mlp.norm_topk_prob is True
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (128, 1000000.0, False)


def _check_llada2(name, model, args, spec):
    # The real config has no use_qk_norm key; LLaDA2MoeConfig's default (True) applies, and the
    # index carries query_layernorm / key_layernorm weights.
    assert "use_qk_norm" not in load_json(name, "config.json")
    assert args.use_qk_norm is True
    assert (args.head_dim, args.partial_rotary_factor, args.rotary_dim) == (128, 0.5, 64)
    assert args.rope_scaling is None
    rope = _rope_of(model)
    assert (rope.dims, rope.base, rope.traditional) == (64, 600000, False)
    assert args.first_k_dense_replace == 1 and len(model.layers) == 20
    assert "gate" not in model.layers[0].mlp  # layer 0 is the dense MLP
    for layer in model.layers[1:]:
        gate = layer.mlp.gate
        assert (gate.top_k, gate.n_group, gate.topk_group) == (8, 8, 4)
        assert gate.routed_scaling_factor == 2.5
        assert gate.expert_bias.shape == (256,) and gate.expert_bias.dtype == mx.float32
        assert "shared_experts" in layer.mlp
    assert args.score_function == "sigmoid" and args.moe_router_enable_expert_bias is True
    assert spec.suppressed_token_ids == ()  # 2.0 / 2.1: no LLaDA2.2 edit-control tokens


def _check_nemotron(name, model, args, spec):
    size = {"3B": (3072, 26, 9216), "8B": (4096, 34, 14336)}[name.rsplit("-", 1)[1]]
    assert (args.hidden_size, args.num_hidden_layers, args.intermediate_size) == size
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (32, 8, 128)
    assert args.vocab_size == 131072 and args.tie_word_embeddings is False
    assert "diffusion_head" in model and "lm_head" not in model
    # YaRN at factor 16 over 16384 trained positions, and the Llama-4 query scaling (beta 0.1).
    rope = _rope_of(model)
    assert type(rope).__name__ == "YarnRoPE" and (rope.dims, rope.traditional) == (128, False)
    assert args.rope_parameters["factor"] == 16.0 and args.rope_parameters["rope_type"] == "yarn"
    attn = model.layers[0]["self_attn"]
    assert (attn.scaling_beta, attn.original_max_position_embeddings) == (0.1, 16384)
    assert spec.attention == "causal_prefix"


def _check_diffusion_gemma(name, model, args, spec):
    text = args.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (2816, 30, 262144)
    assert (text.num_experts, text.top_k_experts, text.moe_intermediate_size) == (128, 8, 704)
    assert args.canvas_length == 256 and args.tie_word_embeddings is True
    assert text.final_logit_softcapping == 30.0
    for i, layer in enumerate(model.layers):
        attn = layer["self_attn"]
        if i % 6 == 5:  # full attention: global head_dim 512, 2 K/V heads, values off the keys
            assert (attn.head_dim, attn.n_kv_heads, attn.use_k_eq_v) == (512, 2, True)
            assert type(attn.rope).__name__ == "ProportionalRoPE"
        else:  # sliding window 1024, head_dim 256, 8 K/V heads
            assert (attn.head_dim, attn.n_kv_heads, attn.is_sliding) == (256, 8, True)
            assert (attn.rope.dims, attn.rope.base) == (256, 10000.0)
        assert attn.n_heads == 16 and attn.scale == 1.0
        assert "router" in layer and "experts" in layer
    assert spec.attention == "encoder_canvas" and spec.mask_token_id is None
    # The image placeholders lie inside the vocabulary.
    for key in ("boi_token_id", "eoi_token_id", "image_token_id"):
        assert 0 <= getattr(args, key) < text.vocab_size, key


def _check_coda(name, model, args, spec):
    # Qwen3-1.7B's body: 28 layers of 2048, 16 query / 8 K/V heads of 128, its own lm_head.
    assert (args.hidden_size, args.num_hidden_layers, args.head_dim) == (2048, 28, 128)
    assert (args.num_attention_heads, args.num_key_value_heads) == (16, 8)
    assert spec.logit_shift == 1 and "lm_head" in model


def _check_rnd1(name, model, args, spec):
    # Qwen3-30B-A3B's body: 48 MoE layers of 128 experts, top 8, experts 768 wide.
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (128, 8, 768)
    assert len(model.layers) == 48 and args.tie_word_embeddings is False
    assert spec.logit_shift == 1 and spec.default_suffix == (151643,)  # the reserved trailing pad


def facts(
    check, mask, eos, max_pos, trained_block=None, stops_too=(), tokens=None, mask_token=None
):
    """A checkpoint's expected facts: `check(name, model, args, spec)`, the spec's mask and EOS ids,
    context and trained block; generation also stops at generation_config.json's `stops_too`;
    `tokens`: ids in its tokenizer files (`mask_token`: the mask's name where they name none)."""
    return dict(
        check=check,
        mask=mask,
        eos=eos,
        runtime_eos=set(eos) | set(stops_too),
        max_pos=max_pos,
        trained_block=trained_block,
        tokens=tokens or {},
        mask_token=mask_token,
    )


QWEN_MASK, QWEN_EOS, IM_END = 151669, (151643,), {"<|im_end|>": 151645}
DREAM = dict(check=_check_dream, mask=151666, eos=QWEN_EOS)
SDAR = dict(mask=QWEN_MASK, eos=QWEN_EOS, max_pos=32768, trained_block=4, stops_too={151645})
LLADA2 = dict(check=_check_llada2, mask=156895, eos=(156892,), max_pos=32768, trained_block=32)
CHECKPOINTS = {
    # tokenizer_config.json has no mask_token entry; <|mdm_mask|> is LLaDA's mask token.
    "GSAI-ML__LLaDA-8B-Instruct": facts(
        _check_llada,
        126336,
        (126081,),
        4096,
        mask_token="<|mdm_mask|>",
        tokens={"<|startoftext|>": 126080, "<|eot_id|>": 126348},
    ),
    # A reconstruction (tests/data/README.md): config.json only, no mask_token_id key.
    "inclusionAI__LLaDA-MoE-7B-A1B-Instruct": facts(_check_llada_moe, 156895, (156892,), 8192),
    "Dream-org__Dream-v0-Instruct-7B": facts(
        **DREAM, max_pos=131072, tokens={**IM_END, "<|beginoftext|>": 151665}
    ),
    # generation_config.json: eos_token_id [151645 <|im_end|>, 151643 <|endoftext|>]
    "JetLM__SDAR-8B-Chat": facts(_check_sdar, **SDAR, tokens=IM_END),
    "JetLM__SDAR-30B-A3B-Chat": facts(_check_sdar_moe, **SDAR, tokens=IM_END),
    # generate.py's stopping ids (151643, 151645) follow the text config's EOS in the spec.
    "JetLM__SDAR-VL-4B": facts(
        _check_sdar_v,
        QWEN_MASK,
        (151643, 151645),
        32768,
        trained_block=4,
        tokens={**IM_END, "<|image_pad|>": 151655},
    ),
    "inclusionAI__LLaDA2.0-mini": facts(**LLADA2),
    "inclusionAI__LLaDA2.1-mini": facts(**LLADA2),
    # Transcriptions (tests/data/README.md): config.json only. The two sizes share the facts.
    **{
        f"nvidia__Nemotron-Labs-Diffusion-{size}": facts(_check_nemotron, 100, (11,), 262144, 32)
        for size in ("3B", "8B")
    },
    # Dream checkpoints of other publishers (transcribed config.json only; tests/test_coders.py).
    "apple__DiffuCoder-7B-Instruct": facts(**DREAM, max_pos=131072),
    "Dream-org__Dream-Coder-v0-Instruct-7B": facts(**DREAM, max_pos=32768),
    "Salesforce__CoDA-v0-Instruct": facts(
        _check_coda, QWEN_MASK, (151645,), 40960, tokens={**IM_END, "<|endoftext|>": 151643}
    ),
    # A reconstruction from configuration_rnd.py's defaults (tests/data/README.md).
    "radicalnumerics__RND1-Base-0910": facts(_check_rnd1, QWEN_MASK, (151645,), 40960),
    # Uniform noise: no mask token.
    "google__diffusiongemma-26B-A4B-it": facts(_check_diffusion_gemma, None, (1, 106, 50), 262144),
}

ALL = sorted(CHECKPOINTS) + sorted(NOT_FOUND)


# ------------------------------------------------------------------------------------ files


# Checkpoints whose weight index was not found (tests/data/README.md): no weight-name check.
NO_INDEX = {
    "inclusionAI__LLaDA-MoE-7B-A1B-Instruct",
    "nvidia__Nemotron-Labs-Diffusion-3B",
    "nvidia__Nemotron-Labs-Diffusion-8B",
    "google__diffusiongemma-26B-A4B-it",
    "apple__DiffuCoder-7B-Instruct",
    "Dream-org__Dream-Coder-v0-Instruct-7B",
    "Salesforce__CoDA-v0-Instruct",
    "radicalnumerics__RND1-Base-0910",
}


@pytest.mark.parametrize("name", ALL)
def test_checkpoint_files_present(name):
    require(name)
    wanted = ("config.json",) + (() if name in NO_INDEX else ("model.safetensors.index.json",))
    for filename in wanted:
        assert load_json(name, filename) is not None, f"{name}/{filename}"
    assert load_json(name, "config.json")["model_type"] in MODEL_TYPES


# --------------------------------------------------------------------------- args and spec


@pytest.mark.parametrize("name", ALL)
def test_args_and_spec(name):
    require(name, "config.json")
    want = CHECKPOINTS[name]
    args, model, spec = built(name)
    assert spec.mask_token_id == want["mask"]
    assert tuple(spec.eos_token_ids) == want["eos"]
    assert spec.trained_block_length == want["trained_block"]
    assert spec.max_position_embeddings == want["max_pos"]
    want["check"](name, model, args, spec)


@pytest.mark.parametrize("name", ALL)
def test_runtime_eos_ids_include_generation_config(name):
    """The ids generation stops at: the spec's, plus generation_config.json's eos_token_id."""
    require(name, "config.json")
    _, model, spec = built(name)
    model.generation_config = load_json(name, "generation_config.json") or {}
    assert eos_ids(model, None, spec) == CHECKPOINTS[name]["runtime_eos"]


# ------------------------------------------------------------ real size, lazily; weight names


@pytest.mark.parametrize("name", ALL)
def test_builds_at_full_size_without_allocating(name):
    """The whole model at its published size (billions of parameters): built, never evaluated."""
    require(name, "config.json")
    before = mx.get_active_memory()
    _, model = build(name)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert count > 1e9, f"{count} parameters: not the published size"
    assert mx.get_active_memory() - before < 200 * MB, "building the model allocated its weights"


@pytest.mark.parametrize("name", ALL)
def test_builds_lazily_and_sanitize_maps_real_weight_names(name):
    require(name, "model.safetensors.index.json")
    before = mx.get_active_memory()
    _, model = build(name)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    assert mx.get_active_memory() - before < 200 * MB, "building the model allocated its weights"

    index = load_json(name, "model.safetensors.index.json")
    rename = getattr(model_module(load_json(name, "config.json")), "_rename_olmo", lambda k: k)
    weights = {
        n: mx.zeros(hf_shape(n, expected, rename), dtype=mx.bfloat16) for n in index["weight_map"]
    }
    out = model.sanitize(dict(weights))
    missing = sorted(set(expected) - set(out))
    unexpected = sorted(set(out) - set(expected))
    assert not missing and not unexpected, (
        f"{len(missing)} missing, e.g. {missing[:5]}; {len(unexpected)} unexpected, e.g. {unexpected[:5]}"
    )
    wrong = {
        k: (tuple(v.shape), expected[k]) for k, v in out.items() if tuple(v.shape) != expected[k]
    }
    assert not wrong, f"shape mismatches after sanitize: {list(wrong.items())[:5]}"
    assert mx.get_active_memory() - before < 200 * MB, "sanitize evaluated the placeholder weights"


# ------------------------------------------------------------------------- special tokens


def _token_content(entry):
    return entry["content"] if isinstance(entry, dict) else entry


@pytest.mark.parametrize("name", ALL)
def test_tokenizer_special_token_ids(name):
    require(name, "tokenizer_config.json")
    tok = load_json(name, "tokenizer_config.json")
    if "added_tokens_decoder" not in tok:
        pytest.skip(
            f"{name}: tokenizer_config.json has no added_tokens_decoder; the special-token ids "
            "live only in tokenizer.json, which is not kept (tests/data/README.md)"
        )
    ids = {v["content"]: int(k) for k, v in tok["added_tokens_decoder"].items()}
    want = CHECKPOINTS[name]
    _, _, spec = built(name)
    special = load_json(name, "special_tokens_map.json") or {}
    mask = want.get("mask_token") or _token_content(tok.get("mask_token") or special["mask_token"])
    assert ids[mask] == spec.mask_token_id == want["mask"]
    eos = _token_content(tok["eos_token"])
    assert ids[eos] in spec.eos_token_ids
    for content, token_id in want["tokens"].items():
        assert ids[content] == token_id, content
    added = load_json(name, "added_tokens.json")
    if added is not None:
        # SDAR-8B-Chat's added_tokens.json names id 151669 "<MASK>" while tokenizer_config.json
        # says "<|MASK|>": the names disagree, the id does not.
        assert want["mask"] in added.values()


@pytest.mark.parametrize("name", ["inclusionAI__LLaDA2.0-mini", "inclusionAI__LLaDA2.1-mini"])
def test_llada2_token_names(name):
    """Without tokenizer.json the LLaDA2 ids cannot be read; the names at least are the Ling ones."""
    require(name, "tokenizer_config.json")
    tok = load_json(name, "tokenizer_config.json")
    special = load_json(name, "special_tokens_map.json")
    for source in (tok, special):
        assert source["mask_token"] == "<|mask|>"
        assert source["eos_token"] == "<|endoftext|>" == source["pad_token"]
