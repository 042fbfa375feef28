"""Independent torch reference for RND1 (radicalnumerics/RND1-Base-0910).

* `reference_logits`: transformers' Qwen3MoeForCausalLM (eager attention) on the checkpoint's own
  weights (transformers' loader fuses the per-expert tensors), under the checkpoint's config
  relabelled qwen3_moe, read bidirectionally: RND1's `rnd/modeling_rnd.py` (RadicalNumerics/RND1 @
  87d5f46) is Qwen3-MoE's attention with `is_causal=False` and its sparse MoE block (softmax router,
  top-k, renormalised when norm_topk_prob) under no mask; an all-zero additive mask is that.
* `diffusion_sample`: a plain transcription of `rnd/sampling.py`'s `diffusion_sample` (same commit),
  with `forward(tokens) -> logits` in place of the model and a seeded torch.Generator for the
  categorical draw. `generate` is `RND1GenerationMixin.generate`'s layout for a prompt:
  seq_len = prompt + max_new_tokens, of which the last position is reserved (pad) because an EOS id
  is set.
"""

import functools

import numpy as np
import torch

from .hf_body import body_logits, load_relabelled

torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    drop = ("auto_map", "mask_token_id", "num_diffusion_steps", "moe_backend", "rope_scaling")
    # RND1Config's defaults write sliding_window / rope_scaling as false (none); RND1's attention
    # reads neither.
    fields = dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], sliding_window=None
    )
    return load_relabelled(ckpt, fields, drop)


def reference_logits(ckpt, input_ids, causal=False):
    x = torch.as_tensor(np.asarray(input_ids)).long()
    return body_logits(load_reference(str(ckpt)), x, causal).numpy()


def reference_forward(ckpt):
    model = load_reference(str(ckpt))
    return lambda x: body_logits(model, x)


# --- rnd/sampling.py ----------------------------------------------------------------------------


def apply_top_k_filtering(logits, k):
    values, indices = torch.topk(logits, min(k, logits.size(-1)), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter_(-1, indices, values)


def apply_top_p_filtering(logits, p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > p
    remove[..., 0] = False
    remove[..., 1:] = remove[..., :-1].clone()
    remove = remove.scatter(-1, sorted_indices, remove)
    return logits.masked_fill(remove, float("-inf"))


def entropy_bounded_unmask(conf_i, ent_i, maskable, eb_gamma, finf):
    """`diffusion_sample`'s step with `eb_gamma`: the maskable positions, most confident first,
    while their entropies summed (less the largest) stay within eb_gamma."""
    err = (-conf_i.clone()).masked_fill(~maskable, finf.max)
    _, idx = torch.sort(err, dim=-1)
    entropy_sorted = torch.gather(ent_i, 1, idx)
    acc_entropy = torch.cumsum(entropy_sorted, dim=-1)
    cummax_entropy, _ = torch.cummax(entropy_sorted, dim=-1)
    valid = (acc_entropy - cummax_entropy) <= eb_gamma
    to_unmask = torch.zeros_like(maskable)
    for b in range(maskable.shape[0]):
        k_b = int(valid[b].sum().item())
        if k_b > 0:
            candidate = torch.zeros_like(maskable[b])
            candidate[idx[b][:k_b]] = True
            to_unmask[b] = candidate & maskable[b]
    return to_unmask


def scheduled_unmask(ent_i, maskable, total_masked, rate, finf):
    """`diffusion_sample`'s step without `eb_gamma`: the highest-entropy `rate` share of the
    initially masked count stays masked, every other maskable position is revealed."""
    cutoff_len = (total_masked * rate).long().clamp(min=0)
    sel_scores = ent_i.masked_fill(~maskable, -finf.max)
    k_max = cutoff_len.max().item()
    keep_mask = torch.zeros_like(sel_scores, dtype=torch.bool)
    if k_max > 0:
        _, idx = torch.topk(sel_scores, k_max, dim=-1, largest=True)
        for b in range(sel_scores.shape[0]):
            k_b = int(cutoff_len[b].item())
            if k_b > 0:
                keep_mask[b, idx[b, :k_b]] = True
    return maskable & ~keep_mask


def diffusion_sample(
    forward,
    seq_len,
    num_steps,
    *,
    mask_token_id,
    prefix_ids,
    top_k=None,
    top_p=None,
    temperature=1.0,
    greedy=True,
    eos_token_id=None,
    pad_token_id=None,
    add_eos_at_end=False,
    eb_gamma=None,
    seed=0,
):
    """`diffusion_sample(model, ...)` for one prefix, no suffix / infill_length / bos:
    (seq_len,) int64, and the number of forwards."""
    g = torch.Generator().manual_seed(seed)
    pad_token_id = 0 if pad_token_id is None else pad_token_id
    prefix = torch.as_tensor(np.asarray(prefix_ids)).long().flatten()
    pre_len = prefix.shape[0]
    used = pre_len + (1 if eos_token_id is not None else 0)
    if used >= seq_len:
        raise ValueError("no space for generation")
    infill_length = seq_len - used
    x = torch.full((1, seq_len), pad_token_id, dtype=torch.long)
    if eos_token_id is not None and add_eos_at_end:
        x[0, -1] = eos_token_id
    x[0, :pre_len] = prefix
    x[0, pre_len : pre_len + infill_length] = mask_token_id
    init_maskable = torch.zeros_like(x, dtype=torch.bool)
    init_maskable[0, pre_len : pre_len + infill_length] = True
    if eos_token_id is not None:
        init_maskable &= x.ne(eos_token_id)
    init_maskable &= x.ne(pad_token_id)
    maskable = init_maskable.clone()
    xt = x.clone()
    nfe = 0

    def forward_scores(tokens):
        nonlocal nfe
        nfe += 1
        logits = torch.as_tensor(np.asarray(forward(tokens))).float()
        logits = logits / max(temperature, 1e-8)
        if top_k is not None and top_k > 0:
            logits = apply_top_k_filtering(logits, top_k)
        if top_p is not None and 0 < top_p < 1.0:
            logits = apply_top_p_filtering(logits, top_p)
        logp = torch.log_softmax(logits, dim=-1)
        if greedy:
            pred_next = logp.argmax(-1)
        else:
            pred_next = torch.multinomial(logp[0].exp(), 1, generator=g).squeeze(-1)[None]
        conf_next = torch.gather(logp, -1, pred_next.unsqueeze(-1)).squeeze(-1)
        p = logp.exp()
        ent_next = -(p * logp).sum(-1)
        # pos i predicts token i+1
        pred_i = tokens.clone()
        conf_i = torch.full_like(conf_next, torch.finfo(conf_next.dtype).min)
        ent_i = torch.zeros_like(ent_next)
        pred_i[:, 1:] = pred_next[:, :-1]
        conf_i[:, 1:] = conf_next[:, :-1]
        ent_i[:, 1:] = ent_next[:, :-1]
        return pred_i, conf_i, ent_i

    pred_i, conf_i, ent_i = forward_scores(xt)
    total_masked = init_maskable.sum(1, keepdim=True)
    finf = torch.finfo(conf_i.dtype)
    for step in range(num_steps - 1, 0, -1):
        if eb_gamma is not None:
            to_unmask = entropy_bounded_unmask(conf_i, ent_i, maskable, eb_gamma, finf)
        else:
            to_unmask = scheduled_unmask(ent_i, maskable, total_masked, step / num_steps, finf)
        if to_unmask.any():
            xt[to_unmask] = pred_i[to_unmask]
            maskable[to_unmask] = False
        if maskable.any():
            pred_i, conf_i, ent_i = forward_scores(xt)
    if maskable.any():
        xt[maskable] = pred_i[maskable]
    return xt[0].numpy().astype(np.int64), nfe


def generate(forward, prompt, max_new_tokens, num_steps, **kw):
    """RND1GenerationMixin.generate(inputs=prompt, max_new_tokens=..., num_diffusion_steps=...)
    with an EOS id set: the sequence prompt + max_new_tokens, the last of which stays pad."""
    seq_len = len(prompt) + max_new_tokens
    return diffusion_sample(forward, seq_len, num_steps, prefix_ids=prompt, **kw)


def greedy_answer(forward, prompt, max_new_tokens, num_steps, *, eos_token_id, **kw):
    """generate(...) at greedy=True, temperature 1 (what temperature 0 is in RND1's sampler):
    (the generated tokens before the pad, cut at the first EOS as the package returns a row's
    tokens; the pad, the sequence's last id; the forwards)."""
    seq, nfe = generate(
        forward,
        prompt,
        max_new_tokens,
        num_steps,
        eos_token_id=eos_token_id,
        greedy=True,
        temperature=1.0,
        **kw,
    )
    toks = seq[len(prompt) : -1].tolist()
    toks = toks[: toks.index(eos_token_id)] if eos_token_id in toks else toks
    return toks, int(seq[-1]), nfe
