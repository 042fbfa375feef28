"""Tiny checkpoints in the exact Hugging Face layout, built offline.

Used by the tests (fixtures) and by the CLI's embedded default when no trained default is shipped.
A checkpoint is a folder with config.json, model.safetensors (real key names), an optional
generation_config.json, and a byte-level tokenizer (ids 0..255 are the bytes, special tokens follow)
holding the family's special tokens and chat template, loadable by transformers' AutoTokenizer.
"""

import json
from pathlib import Path
from typing import Dict, Mapping, Optional

import numpy as np

from .byte_level import bytes_to_unicode
from .models import llada

# Llama-3 style template of LLaDA-8B-Instruct.
LLADA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Qwen ChatML (Dream, SDAR).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(
    path,
    special_tokens: Mapping[str, int],
    *,
    bos_token: Optional[str] = None,
    eos_token: Optional[str] = None,
    pad_token: Optional[str] = None,
    mask_token: Optional[str] = None,
    chat_template: Optional[str] = None,
):
    """Write a byte-level BPE tokenizer (no merges: one token per byte) with `special_tokens`
    (name -> id, ids >= 256, gaps allowed) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet is the 256 printable stand-ins for bytes; order them by byte value.
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    assert set(vocab) == set(byte_symbols)
    next_id = 256
    for name, idx in sorted(special_tokens.items(), key=lambda kv: kv[1]):
        if idx < 256:
            raise ValueError(f"special token {name} needs an id >= 256, got {idx}")
        while next_id < idx:  # fill gaps so ids are exactly as requested
            vocab[f"<|reserved_{next_id}|>"] = next_id
            next_id += 1
        vocab[name] = idx
        next_id = idx + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        mask_token=mask_token,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def write_checkpoint(
    path,
    config: Mapping,
    tensors: Dict[str, np.ndarray],
    *,
    generation_config: Optional[Mapping] = None,
    shards: int = 1,
):
    """Write config.json and safetensors (one file, or `shards` files with an index) as HF does."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config), indent=2))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2))
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = int(sum(v.nbytes for v in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def confident(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    """Random float32 weights of a given spread; output heads of fixtures use a large `scale` so that
    predictions are confident and samplers commit several tokens per step."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


LLADA_SPECIAL_TOKENS = {
    "<|startoftext|>": 256,
    "<|endoftext|>": 257,
    "<|start_header_id|>": 258,
    "<|end_header_id|>": 259,
    "<|eot_id|>": 260,
    "<|mdm_mask|>": 261,
}


def llada_config(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    mlp_hidden_size: int,
    vocab_size: int,
    special_tokens: Mapping[str, int],
    max_sequence_length: int = 4096,
) -> dict:
    """config.json of a LLaDAModelLM (LLaDA-8B's OLMo field names and values) at another size; the
    special ids come from `special_tokens` (LLaDA's names)."""
    return {
        "model_type": llada.MODEL_TYPE,
        "architectures": ["LLaDAModelLM"],
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_heads,
        "mlp_hidden_size": mlp_hidden_size,
        "mlp_ratio": 4,
        "vocab_size": vocab_size,
        "embedding_size": vocab_size,
        "max_sequence_length": max_sequence_length,
        "rope": True,
        "rope_theta": 500000.0,
        "rope_full_precision": True,
        "alibi": False,
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5,
        "layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "attention_layer_norm": False,
        "weight_tying": False,
        "scale_logits": False,
        "input_emb_norm": False,
        "mask_token_id": special_tokens["<|mdm_mask|>"],
        "eos_token_id": special_tokens["<|endoftext|>"],
        "pad_token_id": special_tokens["<|endoftext|>"],
        "bos_token_id": special_tokens["<|startoftext|>"],
        "use_cache": False,
        "block_group_size": 1,
        "torch_dtype": "float32",
    }


def build_tiny_llada(
    path,
    *,
    seed: int = 0,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    mlp_hidden_size: int = 128,
    head_scale: float = 12.0,
):
    """A random LLaDA-8B-shaped checkpoint (LLaDAModelLM, OLMo key names) at toy size: the
    package's offline stand-in when no trained default is available. Its output is not language."""
    vocab = 264
    sizes = dict(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, mlp_hidden_size=mlp_hidden_size
    )
    config = llada_config(
        **sizes, vocab_size=vocab, special_tokens=LLADA_SPECIAL_TOKENS, max_sequence_length=1024
    )
    rng = np.random.default_rng(seed)
    d, f = d_model, mlp_hidden_size
    t = {
        "model.transformer.wte.weight": confident(rng, (vocab, d), 1.0),
        "model.transformer.ln_f.weight": np.ones(d, np.float32),
        "model.transformer.ff_out.weight": confident(rng, (vocab, d), head_scale / d**0.5),
    }
    t["model.transformer.wte.weight"][config["mask_token_id"]] *= 0.05
    t["model.transformer.ff_out.weight"][config["mask_token_id"]] = 0.0  # never proposed
    for i in range(n_layers):
        p = f"model.transformer.blocks.{i}."
        t[p + "attn_norm.weight"] = np.ones(d, np.float32)
        t[p + "ff_norm.weight"] = np.ones(d, np.float32)
        for name in ("q_proj", "k_proj"):
            t[p + name + ".weight"] = confident(rng, (d, d), 3.0 / d**0.5)
        t[p + "v_proj.weight"] = confident(rng, (d, d), 1.0 / d**0.5)
        t[p + "attn_out.weight"] = confident(rng, (d, d), 1.0 / d**0.5)
        t[p + "ff_proj.weight"] = confident(rng, (f, d), 1.0 / d**0.5)
        t[p + "up_proj.weight"] = confident(rng, (f, d), 1.0 / d**0.5)
        t[p + "ff_out.weight"] = confident(rng, (d, f), 1.0 / f**0.5)
    write_checkpoint(path, config, t, generation_config={"eos_token_id": config["eos_token_id"]})
    build_llada_tokenizer(path)
    return Path(path)


def build_llada_tokenizer(path):
    """The byte-level tokenizer with LLaDA's special tokens and chat template, written to `path`."""
    return build_tokenizer(
        path,
        LLADA_SPECIAL_TOKENS,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mdm_mask|>",
        chat_template=LLADA_CHAT_TEMPLATE,
    )
