"""Transcription of SDAR's reference decoding loop, `block_diffusion_generate` in JetAstra/SDAR
generate.py (batch of one), written plainly in torch for token parity tests.

It takes `forward(ids, keep) -> logits`: ids (1, L) over the window, keep the (L, L) boolean
block-causal mask, logits (1, L, V). Two deliberate differences from the reference:

* The reference keeps a KV cache: the prompt's whole blocks are prefilled with store_kv=True, each
  denoising forward runs the current block alone against the cache, and a finished block costs one
  more forward with store_kv=True. Here every step runs the window x[:, :(b+1)*B] under the same
  mask and keeps its last block's logits: the same computation. The forwards the reference would
  run (prefill, denoising, one store per finished block) are still counted and returned.
* `topk_over_masks_only` (off by default): the reference's top-k runs over the whole block with
  confidence -inf outside the masks, so when a step's quota exceeds the masks left (several tokens
  a step, after a threshold step committed more, or a prompt tail in the first block) it also
  "commits" non-mask positions, rewriting committed or even prompt tokens with the proposal.
  Switched on, the top-k takes min(quota, masks left), as the engine does.
* Temperature 0: the reference always samples and divides the logits by the temperature unless it
  is 1.0, so T=0 divides by zero. Greedy here: the argmax of the (top-k / top-p filtered) logits,
  with its probability under their softmax.
"""

import torch
import torch.nn.functional as F


def top_k_logits(logits, k):
    if k <= 0:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)


def top_p_logits(logits, p):
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    drop_sorted = cumulative > p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits, temperature, top_k, top_p):
    """(token, probability) per position, as sample_with_temperature_topk_topp."""
    shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    if temperature == 0:
        if top_k > 0:
            logits = top_k_logits(logits, top_k)
        if top_p < 1.0:
            logits = top_p_logits(logits, top_p)
        probs = F.softmax(logits, dim=-1)
        token = torch.argmax(logits, dim=-1, keepdim=True)
        return token.view(shape), torch.gather(probs, -1, token).view(shape)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        logits = top_k_logits(logits, top_k)
    if top_p < 1.0:
        logits = top_p_logits(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1)
    return token.view(shape), torch.gather(probs, -1, token).view(shape)


def num_transfer_tokens(block_length, steps):
    out = torch.zeros(steps, dtype=torch.int64) + block_length // steps
    out[: block_length % steps] += 1
    return out


def block_causal_keep(total_length, block_length):
    nb = total_length // block_length
    tril = torch.tril(torch.ones(nb, nb))
    keep = tril.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    return keep.bool()


@torch.no_grad()
def sdar_generate(
    forward,
    prompt,
    mask_id,
    gen_length=128,
    block_length=8,
    denoising_steps=8,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    remasking_strategy="low_confidence_dynamic",
    confidence_threshold=0.85,
    stopping_criteria_idx=None,
    topk_over_masks_only=False,
    eb_threshold=None,
):
    """Returns (x, forwards): the whole canvas (prompt, blocks, trailing masks) and the number of
    model forwards the reference would run with its KV cache."""
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    keep = block_causal_keep(total_length, block_length)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    prefill_blocks = prompt_length // block_length
    forwards = 1 if prefill_blocks > 0 else 0
    schedule = num_transfer_tokens(block_length, denoising_steps)

    for num_block in range(prefill_blocks, num_blocks):
        lo, hi = num_block * block_length, (num_block + 1) * block_length
        cur_x = x[:, lo:hi].clone()
        for step in range(denoising_steps + 1):
            mask_index = cur_x == mask_id
            if mask_index.sum() == 0:
                forwards += 1  # the store_kv forward of the finished block
                break
            window = torch.cat([x[:, :lo], cur_x], dim=1)
            logits = forward(window, keep[:hi, :hi])[:, lo:hi]
            forwards += 1
            x0, x0_p = sample(logits, temperature, top_k, top_p)
            k = int(schedule[step])
            top = min(k, int(mask_index.sum())) if topk_over_masks_only else k
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            if remasking_strategy == "sequential":
                first = int(mask_index[0].nonzero()[0].min())
                transfer[0, first : first + k] = True
            elif remasking_strategy == "low_confidence_static":
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                transfer[0, torch.topk(confidence[0], top).indices] = True
            elif remasking_strategy == "low_confidence_dynamic":
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                high = confidence[0] > confidence_threshold
                if high.sum() >= k:
                    transfer[0] = high
                else:
                    transfer[0, torch.topk(confidence[0], top).indices] = True
            elif remasking_strategy == "entropy_bounded":
                # As upstream: the "entropy" of x0_p (1, B) summed over its last axis, i.e. over
                # the block's positions, broadcast to every mask; ties sorted in position order
                # (stable=True says so; upstream's torch.sort is unstable by contract).
                eps = 1e-12
                p = x0_p.clamp_min(eps)
                entropies = -(p * p.log()).sum(dim=-1)
                entropies = torch.where(mask_index, entropies, torch.inf)
                ent_sorted, order = torch.sort(entropies, dim=1, descending=False, stable=True)
                cumsum = torch.cumsum(ent_sorted, dim=1)
                n = torch.searchsorted(cumsum[0], torch.tensor(eb_threshold), right=False).item()
                n = max(1, min(n, int(mask_index[0].sum().item())))
                transfer[0, order[0, :n]] = True
            else:
                raise ValueError(remasking_strategy)
            cur_x[transfer] = x0[transfer]
        x[:, lo:hi] = cur_x
        if stopping_criteria_idx is not None and any(
            (x[:, prompt_length:] == s).any() for s in stopping_criteria_idx
        ):
            break
    return x, forwards
