"""Independent torch reference for SDAR / SDAR-MoE.

SDAR's `modeling_sdar.py` is Qwen3's math (SDAR-MoE: Qwen3-MoE's) with the attention mask supplied by
the caller. The reference is transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM, loaded with
`from_pretrained` from the checkpoint's weights (identical key names; transformers' loader fuses the
MoE experts itself) under the checkpoint's config relabelled as qwen3 / qwen3_moe, eager attention,
and a 4-D additive mask (transformers returns a 4-D mask as-is and eager attention adds it).
"""

import functools

import numpy as np
import torch

from .hf_body import keys_in_view, load_relabelled, logits_under

torch.set_num_threads(1)

_QWEN = {"sdar": ("qwen3", "Qwen3ForCausalLM"), "sdar_moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    def fields(cfg):
        model_type, arch = _QWEN[cfg["model_type"]]
        return dict(model_type=model_type, architectures=[arch])

    return load_relabelled(ckpt, fields, drop=("auto_map", "block_size", "mask_token_id"))


def block_causal_keep(length, block_length):
    """Rows of tril(ones(nb, nb)) repeated by block, as SDAR's generate.py builds its mask."""
    nb = -(-length // block_length)
    tril = torch.tril(torch.ones(nb, nb, dtype=torch.bool))
    keep = tril.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    return keep[:length, :length]


def reference_logits(ckpt, input_ids, block_length, layout="block"):
    """float32 logits (B, L, V) under the block-causal mask (`layout="block"`), or, to show that a
    test can fail, the causal ("causal") or bidirectional ("full") reading."""
    model = load_reference(str(ckpt))
    x = torch.as_tensor(np.asarray(input_ids)).long()
    L = x.shape[1]
    if layout == "block":
        keep = block_causal_keep(L, block_length)
    elif layout in ("causal", "full"):
        keep = keys_in_view(L, causal=layout == "causal")
    else:
        raise ValueError(layout)
    return logits_under(model, x, keep).numpy()
