"""Independent torch reference for Open-dCoder (pengzhangzhi/Open-dLLM, veomni/models/transformers/
qwen2/: modeling_qwen2.py and generation_utils.py, read in the code index).

* `reference_logits`: transformers' Qwen2ForCausalLM (eager attention) on the checkpoint's weights
  under an all-keep 4-D mask. veomni's Qwen2 is transformers' layer math; `_mdm_sample` calls it
  with `is_causal=False` and no attention mask (the config has no pad_token_id), which under SDPA /
  flash attention is full attention over the sequence, positions 0..L-1. `causal=True` is
  transformers' own (AR) reading, which the diffusion model must not match.
* `mdm_sample`: `MDMGenerationMixin._mdm_sample` transcribed for algs "p2", "entropy",
  "maskgit_plus", "topk_margin" (and `sample_tokens`: temperature, top-p, top-k in that order),
  logits shifted right by one. Its draws go through two seams: `draw_x0(probs, step)` for
  Categorical(probs).sample() (default: that, from a seeded generator) and `gumbel(shape, step)`
  for the Gumbel noise of the alg_temp ranking (default: upstream's formula from torch.rand), so a
  test can feed both sides the same noise.
"""

import functools

import numpy as np
import torch
import torch.distributions as dists

from .dream_torch import top_p_logits  # veomni's generation_utils copies Dream's
from .hf_body import body_logits, qwen2_model

torch.set_num_threads(1)


@functools.lru_cache(maxsize=2)
def load_reference(ckpt):
    return qwen2_model(ckpt)


def reference_logits(ckpt, input_ids, causal=False):
    """Unshifted float32 logits (B, L, V) of token ids."""
    x = torch.as_tensor(np.asarray(input_ids)).long()
    return body_logits(load_reference(str(ckpt)), x, causal).numpy()


def top_k_logits(logits, top_k):
    if not top_k:
        return logits
    kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(logits, temperature, top_p, top_k, alg, draw_x0):
    """generation_utils.sample_tokens -> (confidence, x0)."""
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    if temperature > 0:
        x0 = draw_x0(probs)
    else:
        _, x0 = probs.max(dim=-1)
    confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    if alg == "topk_margin":
        top = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top[..., 0] - top[..., 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs.clamp(min=1e-10))).sum(dim=-1)
    return confidence, x0


def _p2_step(x, logits, fix_mask, mask_index, i, steps, sample, mask_token_id):
    kappa = (i + 1) / steps
    confidence, x0 = sample(logits)
    confidence[fix_mask] = float("inf")
    num_positions = (~fix_mask).sum(dim=1, keepdim=True)
    num_to_mask = (num_positions.float() * (1 - kappa)).long()
    sorted_idx = torch.argsort(confidence, dim=-1, descending=False)
    most = int(num_to_mask.max())
    valid = torch.arange(most).unsqueeze(0) < num_to_mask
    to_mask = torch.zeros_like(x, dtype=torch.bool)
    rows = torch.arange(x.size(0)).unsqueeze(1).expand(-1, most)[valid]
    to_mask[rows, sorted_idx[:, :most][valid]] = True
    x[to_mask] = mask_token_id
    unmask = mask_index & ~to_mask
    x[unmask] = x0[unmask]


def _ranked_step(x, logits, mask_index, t, s, last, alg_temp, sample, gumbel, mask_token_id):
    confidence, x0 = sample(logits[mask_index])
    counts = mask_index.sum(dim=1)
    n = counts if last else (counts.float() * (1 - s / t)).long()
    full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
    full[mask_index] = confidence.to(logits.dtype)
    most = int(n.max())
    if most == 0:
        return
    if not alg_temp:
        _, idx = torch.topk(full, most, dim=1)
    else:
        _, idx = torch.topk(full / alg_temp + gumbel(full.shape), most, dim=1)
    valid = torch.arange(most).unsqueeze(0) < n.unsqueeze(1)
    rows = torch.arange(x.size(0)).unsqueeze(1).expand_as(idx)[valid]
    proposal = torch.zeros_like(x) + mask_token_id
    proposal[mask_index] = x0.clone()
    x[rows, idx[valid]] = proposal[rows, idx[valid]]


def mdm_sample(
    forward,
    prompt_ids,
    max_new_tokens,
    steps,
    *,
    mask_token_id,
    alg="p2",
    alg_temp=0.0,
    eps=1e-3,
    temperature=0.0,
    top_p=None,
    top_k=None,
    seed=0,
    draw_x0=None,
    gumbel=None,
):
    """`model.diffusion_generate(inputs, max_new_tokens=, steps=, ...)` -> ((B, L + N) int64
    sequences, forwards run). `forward(x)` returns unshifted logits."""
    g = torch.Generator().manual_seed(seed)
    if draw_x0 is None:
        draw_x0 = lambda probs, step: dists.Categorical(probs=probs).sample()  # noqa: E731
    if gumbel is None:

        def gumbel(shape, step):
            u = torch.rand(shape, generator=g).clamp_(min=1e-20, max=1 - 1e-20)
            return -torch.log(-torch.log(u))

    x = torch.as_tensor(np.asarray(prompt_ids)).long()
    x = torch.cat([x, torch.full((x.shape[0], max_new_tokens), mask_token_id)], dim=1)
    fix_mask = x != mask_token_id
    timesteps = torch.linspace(1, eps, steps + 1)
    forwards = 0
    for i in range(steps):
        mask_index = x == mask_token_id
        if not mask_index.any():
            break
        logits = torch.as_tensor(np.asarray(forward(x.numpy()))).float()
        forwards += 1
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

        def sample(lg):
            return sample_tokens(lg, temperature, top_p, top_k, alg, lambda p: draw_x0(p, i))

        if alg == "p2":
            _p2_step(x, logits, fix_mask, mask_index, i, steps, sample, mask_token_id)
        elif alg in ("maskgit_plus", "entropy", "topk_margin"):
            t, s = timesteps[i], timesteps[i + 1]
            noise = lambda shape: gumbel(shape, i)  # noqa: E731
            _ranked_step(
                x, logits, mask_index, t, s, i == steps - 1, alg_temp, sample, noise, mask_token_id
            )
        else:
            raise NotImplementedError(alg)
    return x.numpy(), forwards
