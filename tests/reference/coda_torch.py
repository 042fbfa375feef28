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
import torch.nn.functional as F

from .dream_torch import sample_tokens
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
# Its top_p_logits, top_k_logits and sample_tokens are Dream's (dream_torch), which it copies.


def coda_generate(
    forward,
    prompt_ids,
    max_new_tokens,
    steps,
    alg="origin",
    alg_temp=None,
    eps=1e-3,
    temperature=0.0,
    top_p=None,
    top_k=None,
    *,
    mask_token_id,
    seed=0,
    draw_positions=None,
):
    """`model.diffusion_generate(inputs, max_new_tokens=..., steps=..., ...)` -> (B, L + N) int64
    sequences (prompt + canvas; no EOS handling). `forward(x)` returns unshifted logits."""
    g = torch.Generator().manual_seed(seed)
    if draw_positions is None:
        draw_positions = lambda probs, n: torch.multinomial(probs, n, generator=g)  # noqa: E731
    x = torch.as_tensor(np.asarray(prompt_ids)).long()
    max_length = x.shape[1] + max_new_tokens
    x = F.pad(x, (0, max_length - x.shape[1]), value=mask_token_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_token_id
        logits = torch.as_tensor(np.asarray(forward(x))).float()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + mask_token_id
            transfer = torch.rand(x0.shape, generator=g) < p_transfer
            _, x0[transfer] = sample_tokens(
                mask_logits[transfer], temperature, top_p, top_k, generator=g
            )
            x[mask_index] = x0.clone()
            continue
        kinds = {"maskgit_plus": {}, "topk_margin": {"margin_confidence": True}, "entropy": {}}
        if alg not in kinds:
            raise RuntimeError(f"Unknown alg: {alg}")
        confidence, x0 = sample_tokens(
            mask_logits,
            temperature,
            top_p,
            top_k,
            neg_entropy=alg == "entropy",
            generator=g,
            **kinds[alg],
        )
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        n = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if n > 0:
            if alg_temp is None or alg_temp == 0:
                _, transfer_index = torch.topk(full_confidence, n)
            else:
                probs = F.softmax(full_confidence / alg_temp, dim=-1)
                transfer_index = draw_positions(probs, n)
            x_ = torch.zeros_like(x) + mask_token_id
            x_[mask_index] = x0.clone()
            rows = torch.arange(x.size(0))[:, None].expand_as(transfer_index)
            x[rows, transfer_index] = x_[rows, transfer_index]
    return x.numpy().astype(np.int64)
