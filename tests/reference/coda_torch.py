"""Independent torch reference for CoDA (Salesforce/CoDA-v0-Instruct).

* `reference_logits`: transformers' Qwen3ForCausalLM (eager attention) on the checkpoint's own
  weights, under the checkpoint's config relabelled qwen3 with its own head, read bidirectionally.
  CoDA's `modeling_coda.py` (SalesforceAIResearch/CoDA @ fa1d505, CoDALanguageModel/) is Qwen3's
  math; its `attention.py` calls scaled_dot_product_attention with is_causal=False and no mask, so
  an all-zero additive mask (eager attention adds the 4-D mask it is given) is its reading.
* `coda_generate`: a plain transcription of CoDALanguageModel/generation_utils.py's
  `diffusion_generate` / `_sample` / `sample_tokens` (adapted there from Dream's). In eval mode the
  model ignores the attention mask (CoDALanguageModel.forward passes attention_mask=None), so no
  padding is modelled. Draws: a seeded torch.Generator, `torch.multinomial` for the categorical
  sample (Categorical's distribution); `draw_positions(probs, n)` is the seam for alg_temp's
  `torch.multinomial(full_confidence, n)` (a test replays the engine's noise through it).
"""

import functools

import numpy as np
import torch

from .dream_torch import dream_generate
from .hf_body import body_logits, load_relabelled

torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    drop = ("auto_map", "mask_token_id", "attention_kernel", "sampling_eps", "mask_block_sizes")
    # CoDALanguageModel's lm_head is never tied to the embedding (see models/coda.py).
    fields = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    return load_relabelled(ckpt, fields, drop)


def reference_logits(ckpt, input_ids, causal=False):
    """Unshifted float32 logits (B, L, V); `causal=True` is Qwen3's own reading, which a correct
    CoDA must not match."""
    x = torch.as_tensor(np.asarray(input_ids)).long()
    return body_logits(load_reference(str(ckpt)), x, causal).numpy()


def reference_forward(ckpt):
    """`forward(x) -> logits` for `coda_generate`, backed by the torch reference."""
    model = load_reference(str(ckpt))
    return lambda x: body_logits(model, x)


# --- generation_utils.py ---------------------------------------------------------------------
# Its diffusion_generate / _sample, top_p_logits, top_k_logits and sample_tokens are Dream's
# (dream_torch), which it copies; only the attention mask is not read (eval mode).


def coda_generate(forward, prompt_ids, max_new_tokens, steps, **settings):
    """`model.diffusion_generate(inputs, max_new_tokens=..., steps=..., **settings)` -> (B, L + N)
    int64 sequences (prompt + canvas; no EOS handling): dream_generate's, whose keyword arguments
    `settings` are (alg, alg_temp, eps, temperature, top_p, top_k, mask_token_id, seed,
    draw_positions). `forward(x)` returns unshifted logits."""
    return dream_generate(
        lambda x, keep, tok_idx: forward(x), prompt_ids, max_new_tokens, steps, **settings
    )
