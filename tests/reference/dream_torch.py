"""Independent torch reference for Dream.

* `reference_logits`: transformers' Qwen2ForCausalLM (eager attention) on the checkpoint's own weights,
  read bidirectionally. Dream's `modeling_dream.py` is Qwen2's math with `is_causal=False`; eager
  attention adds whatever 4-D mask it is given, so an all-zero additive mask is full attention.
  Padding follows Dream's `_sample`: keep = m[:, None, :, None] & m[:, None, None, :], positions
  cumsum(m) - 1 with pads at position 1, both only when the batch really has padding.
* `dream_generate`: a plain transcription of Dream's `diffusion_generate` / `_sample` / `sample_tokens`
  (HF generation_utils.py; copy read in ZHZisZZ/dllm dllm/pipelines/dream/models/generation_utils.py).
  Draws use a seeded torch.Generator (`torch.multinomial` in place of `Categorical.sample`, the same
  distribution), so runs repeat; `origin` draws its transfer set even at temperature 0.
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .hf_body import qwen2_model

torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def load_reference(ckpt):
    return qwen2_model(ckpt)


def _run(model, x, keep=None, position_ids=None):
    """Logits (B, L, V) of token ids x under a boolean keep-mask (B, 1, L, L) (None = full)."""
    B, L = x.shape
    if keep is None:
        keep = torch.ones(B, 1, L, L, dtype=torch.bool)
    additive = torch.zeros(keep.shape, dtype=torch.float32).masked_fill(
        ~keep, torch.finfo(torch.float32).min
    )
    if position_ids is None:
        position_ids = torch.arange(L).expand(B, L)
    with torch.no_grad():
        out = model(
            input_ids=x, attention_mask=additive, position_ids=position_ids, use_cache=False
        )
    return out.logits.float()


def dream_padding(attention_mask):
    """Dream's `_sample` padding: (4-D bool keep-mask, positions), or (None, None) without pads."""
    m = torch.as_tensor(np.asarray(attention_mask)).long()
    if not bool((m == 0).any()):
        return None, None
    tok_idx = m.cumsum(-1) - 1
    tok_idx = tok_idx.masked_fill(m == 0, 1)
    mb = m.bool()
    keep = mb[:, None, :, None] & mb[:, None, None, :]
    return keep, tok_idx


def reference_logits(ckpt, input_ids, attention_mask=None, causal=False):
    """Unshifted float32 logits (B, L, V). `causal=True` gives the causal Qwen2 reading, which a
    correct Dream must NOT match (used to show the parity test can fail)."""
    model = load_reference(str(ckpt))
    x = torch.as_tensor(np.asarray(input_ids)).long()
    B, L = x.shape
    keep, pos = (None, None) if attention_mask is None else dream_padding(attention_mask)
    if causal:
        tril = torch.tril(torch.ones(L, L, dtype=torch.bool))[None, None]
        keep = tril if keep is None else keep & tril
        keep = keep.expand(B, 1, L, L)
    return _run(model, x, keep, pos).numpy().astype(np.float32)


def reference_forward(ckpt):
    """A `forward(x, attention_mask, tok_idx)` for `dream_generate` backed by the torch reference."""
    model = load_reference(str(ckpt))
    return lambda x, attention_mask, tok_idx: _run(model, x, attention_mask, tok_idx)


# --- Dream's sampling loop -------------------------------------------------------------------


def top_p_logits(logits, top_p):
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()  # keep the token that crosses top_p
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_logits(logits, top_k):
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def sample_tokens(
    logits,
    temperature=0.0,
    top_p=None,
    top_k=None,
    margin_confidence=False,
    neg_entropy=False,
    generator=None,
):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        try:
            x0 = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            confidence = torch.gather(probs, -1, x0[:, None]).squeeze(-1)
        except Exception:
            confidence, x0 = probs.max(dim=-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


def dream_generate(
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
    attention_mask=None,
    seed=0,
    output_history=False,
    draw_positions=None,
):
    """Dream's `diffusion_generate(inputs, max_new_tokens=..., steps=..., ...)` -> sequences (B, L + N)
    as np.int64 (prompt + canvas, no EOS handling: callers split at EOS), and the per-step history if
    asked. `forward(x, attention_mask, tok_idx)` returns unshifted logits (B, L, V) (torch, numpy or
    anything np.asarray takes); attention_mask is None (full) or a 4-D bool keep-mask, tok_idx None or
    (B, L) positions. `draw_positions(probs, n)` is the seam for alg_temp's
    `torch.multinomial(full_confidence, n)` (a test replays the engine's noise through it)."""
    g = torch.Generator().manual_seed(seed)
    if draw_positions is None:
        draw_positions = lambda probs, n: torch.multinomial(probs, n, generator=g)  # noqa: E731
    x = torch.as_tensor(np.asarray(prompt_ids)).long()
    max_length = x.shape[1] + max_new_tokens
    x = F.pad(x, (0, max_length - x.shape[1]), value=mask_token_id)

    keep, tok_idx = None, None
    if attention_mask is not None:
        m = torch.as_tensor(np.asarray(attention_mask)).long()
        if bool((m == 0).any()):
            m = F.pad(m, (0, max_length - m.shape[1]), value=1)  # the canvas is attended
            keep, tok_idx = dream_padding(m)

    timesteps = torch.linspace(1, eps, steps + 1)
    history = []
    for i in range(steps):
        mask_index = x == mask_token_id
        logits = torch.as_tensor(np.asarray(forward(x, keep, tok_idx))).float()
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
        else:
            if alg == "maskgit_plus":
                confidence, x0 = sample_tokens(mask_logits, temperature, top_p, top_k, generator=g)
            elif alg == "topk_margin":
                confidence, x0 = sample_tokens(
                    mask_logits, temperature, top_p, top_k, margin_confidence=True, generator=g
                )
            elif alg == "entropy":
                confidence, x0 = sample_tokens(
                    mask_logits, temperature, top_p, top_k, neg_entropy=True, generator=g
                )
            else:
                raise RuntimeError(f"Unknown alg: {alg}")
            # Dream's pitfall, kept: the batch-mean mask count sets every row's quota.
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            n_transfer = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
            full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            if n_transfer > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full_confidence, n_transfer)
                else:
                    probs = F.softmax(full_confidence / alg_temp, dim=-1)
                    transfer_index = draw_positions(probs, n_transfer)
                x_ = torch.zeros_like(x) + mask_token_id
                x_[mask_index] = x0.clone()
                rows = torch.arange(x.size(0))[:, None].expand_as(transfer_index)
                x[rows, transfer_index] = x_[rows, transfer_index]
        if output_history:
            history.append(x.clone().numpy())
    out = x.numpy().astype(np.int64)
    return (out, history) if output_history else out


def dream_log_likelihood(
    forward, prefix, target, draws, batch_size, *, mask_token_id, sampling_eps=1e-3
):
    """DreamLM/Dream `eval/eval.py` `_eval_target_nll_mc` with log_type "ftb" (and the sign
    flip of `loglikelihood`), transcribed with its draws given: `draws` holds one (t, u) per
    batch, t (B,) the rows' noise levels `(u0 + b/B) % 1` and u (B, L) the `torch.rand` mask draws.
    `target` already ends with the EOS that `_encode_pair` appends. `forward(ids)` -> unshifted
    logits (B, L, V)."""
    prefix = torch.as_tensor(np.asarray(prefix), dtype=torch.long)
    target = torch.as_tensor(np.asarray(target), dtype=torch.long)
    seq = torch.cat([prefix, target])[None, :].repeat((batch_size, 1))

    def forward_process(batch, t, u):
        b, l = batch.shape
        t = torch.as_tensor(np.asarray(t), dtype=torch.float32)
        p_mask = (1 - sampling_eps) * t + sampling_eps
        p_mask = p_mask[:, None].repeat(1, l)
        mask_indices = torch.as_tensor(np.asarray(u), dtype=torch.float32) < p_mask
        mask_indices[:, 0] = False
        mask_indices[:, -1] = False
        return torch.where(mask_indices, mask_token_id, batch), p_mask

    loss_acc = []
    for t, u in draws:
        perturbed_seq = seq.clone()
        perturbed_seq_, p_mask = forward_process(seq, t, u)
        perturbed_seq[:, -len(target) :] = perturbed_seq_[:, -len(target) :]
        mask_indices = perturbed_seq == mask_token_id
        logits = torch.as_tensor(np.asarray(forward(perturbed_seq))).double()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        loss = F.cross_entropy(logits[mask_indices], seq[mask_indices], reduction="none")
        loss = loss / p_mask[mask_indices]
        loss_acc.append(loss.sum().item() / batch_size)
    return -sum(loss_acc) / len(loss_acc)
