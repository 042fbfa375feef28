"""Independent reference for Nemotron-Labs-Diffusion decoding (tests only).

`hf_generate(...)` is a plain transcription of the HF remote code's
`NemotronLabsDiffusionModel.generate` (modeling_nemotron_labs_diffusion.py) with
causal_context=True: a causal prefill into a KV cache whose last logit gives the next token; per
block, `block_length` masks with that token at position 0; `block_length` steps of a bidirectional
forward over the block only, reading the cache without writing it (`use_cache=False`), then
`_get_transfer_index` (LLaDA style: Gumbel noise in float64, softmax confidence, top-k of the
schedule `_get_num_transfer_tokens`, and with `threshold` every mask ranked, the first always kept,
the others kept when confidence >= threshold); the block loop breaks once some row has an EOS with
no mask before it; then a causal forward over the block appends its K/V and gives the next token.
Returns (ids including the prompt, nfe), cut after the first EOS as the reference does.

The forwards run on mlx-vlm's implementation (`VlmForward`), not this package's: its KV cache
reads the prefix by concatenation, which is what `use_cache=False` does in the HF code.
"""

import mlx.core as mx
import numpy as np


class VlmForward:
    """`model(ids, past_key_values, use_cache, use_causal_mask) -> (logits, past_key_values)`, the
    calls the HF generate makes, on an mlx-vlm `nemotron_labs_diffusion.Model`."""

    def __init__(self, vlm_model):
        self.vlm = vlm_model

    def __call__(self, ids, past_key_values=None, use_cache=False, use_causal_mask=False):
        if past_key_values is None:
            past_key_values = self.vlm.make_cache()
        out = self.vlm(
            mx.array(np.asarray(ids), dtype=mx.int32),
            cache=past_key_values,
            use_cache=use_cache,
            use_causal_mask=use_causal_mask,
        ).logits
        return np.array(out.astype(mx.float32), dtype=np.float64), past_key_values


def _softmax(logits):
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _add_gumbel_noise(logits, temperature, rng):
    if temperature == 0:
        return logits
    noise = rng.random(logits.shape)
    return np.exp(logits) / (-np.log(noise)) ** temperature


def _get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(axis=1, keepdims=True)
    base, remainder = mask_num // steps, mask_num % steps
    out = np.zeros((mask_num.shape[0], steps), dtype=np.int64) + base
    for i in range(mask_num.shape[0]):
        out[i, : int(remainder[i, 0])] += 1
    return out


def _get_transfer_index(logits, temperature, mask_index, x, num_transfer_tokens, threshold, rng):
    x0 = np.argmax(_add_gumbel_noise(logits, temperature, rng), axis=-1)
    p = _softmax(logits)
    x0_p = np.take_along_axis(p, x0[..., None], axis=-1)[..., 0]
    x0 = np.where(mask_index, x0, x)
    confidence = np.where(mask_index, x0_p, -np.inf)
    transfer = np.zeros_like(x0, dtype=bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(axis=1)
    for j in range(confidence.shape[0]):
        k = int(num_transfer_tokens[j])
        select = np.argsort(-confidence[j], kind="stable")[:k]  # torch.topk: highest first
        transfer[j, select] = True
        if threshold is not None:
            for r in range(1, k):
                if confidence[j, select[r]] < threshold:
                    transfer[j, select[r]] = False
    return x0, transfer


def hf_generate(
    model,
    prompt_ids,
    max_new_tokens,
    block_length,
    mask_id,
    eos_token_id,
    threshold=None,
    temperature=0.0,
    seed=0,
):
    rng = np.random.default_rng(seed)
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    x_accum = prompt_ids.copy()
    B, prompt_len = prompt_ids.shape
    assert max_new_tokens % block_length == 0
    num_blocks = max_new_tokens // block_length
    steps_per_block = block_length
    nfe = 0

    def next_of(last_logit):
        if temperature > 0:
            probs = _softmax(last_logit / temperature)
            return np.array([[rng.choice(probs.shape[-1], p=row)] for row in probs])
        return np.argmax(last_logit, axis=-1)[:, None]

    logits, past_key_values = model(prompt_ids, use_cache=True, use_causal_mask=True)
    next_token = next_of(logits[:, -1, :])

    for num_block in range(num_blocks):
        mask_block = np.full((B, block_length), mask_id, dtype=np.int64)
        mask_block[:, 0] = next_token[:, 0]
        x_accum = np.concatenate([x_accum, mask_block], axis=1)
        block_start = prompt_len + num_block * block_length
        block = slice(block_start, block_start + block_length)

        mask_index = x_accum[:, block] == mask_id
        num_transfer_tokens = _get_num_transfer_tokens(mask_index, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x_accum[:, block] == mask_id
            if mask_index.sum() == 0:
                break
            nfe += 1
            logits, _ = model(x_accum[:, block], past_key_values=past_key_values, use_cache=False)
            x0, transfer = _get_transfer_index(
                logits,
                temperature,
                mask_index,
                x_accum[:, block],
                num_transfer_tokens[:, i],
                threshold,
                rng,
            )
            cur = x_accum[:, block].copy()
            cur[transfer] = x0[transfer]
            x_accum[:, block] = cur

            tokens = x_accum[:, block]
            eos_mask = tokens == eos_token_id
            if eos_mask.any():
                after_eos = np.cumsum(eos_mask, axis=1) > 0
                mask_before = (tokens == mask_id) & ~after_eos
                if (eos_mask.any(axis=1) & ~mask_before.any(axis=1)).any():
                    break

        logits, past_key_values = model(
            x_accum[:, block], past_key_values=past_key_values, use_cache=True, use_causal_mask=True
        )
        nfe += 1
        next_token = next_of(logits[:, -1, :])

        is_eos = x_accum[:, prompt_len:] == eos_token_id
        if is_eos.any(axis=1).all():
            max_eos = int(is_eos.argmax(axis=1).max())
            return x_accum[:, : prompt_len + max_eos + 1], nfe
    return x_accum, nfe


def generate_with_prefix_cache_block_diff(
    model,
    prompt,
    steps,
    gen_length,
    block_length,
    mask_id,
    threshold=None,
    causal_context=False,
    eos_token_id=None,
    max_thinking_tokens=None,
    end_think_token_id=None,
):
    """A plain transcription of NVIDIA's chat_utils.generate_with_prefix_cache_block_diff (what
    the remote code's generate_diffusion calls) at temperature 0, remasking="low_confidence",
    token ids (no prompt_embeds), shift_logits=False, neg_entropy=False. Returns (ids including the
    prompt, nfe), cut after the latest first EOS once every row has one, as the reference does.

    causal_context=False: the prompt's forward (which fills the cache) and each finished block's
    are bidirectional (use_causal_mask=False) and no block is seeded. The thinking budget: at a
    block whose end passes max_thinking_tokens, rows with no end_think_token_id among the new
    tokens of the earlier blocks get it at offset max(0, max_thinking_tokens - tokens before the
    block), before the block's schedule is computed."""
    x_accum = np.asarray(prompt, dtype=np.int64).copy()
    B, prompt_len = x_accum.shape
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    nfe = 0

    logits, past_key_values = model(x_accum, use_cache=True, use_causal_mask=causal_context)
    next_token = np.argmax(logits[:, -1, :], axis=-1)[:, None] if causal_context else None

    for num_block in range(num_blocks):
        mask_block = np.full((B, block_length), mask_id, dtype=np.int64)
        if causal_context:
            mask_block[:, 0] = next_token[:, 0]
        x_accum = np.concatenate([x_accum, mask_block], axis=1)
        current_block_start = prompt_len + num_block * block_length
        block = slice(current_block_start, current_block_start + block_length)

        if end_think_token_id is not None and max_thinking_tokens is not None:
            tokens_before_block = num_block * block_length
            tokens_after_block = tokens_before_block + block_length
            if tokens_after_block > max_thinking_tokens:
                gen_so_far = x_accum[:, prompt_len:current_block_start]
                if gen_so_far.shape[1] > 0:
                    has_end_think = (gen_so_far == end_think_token_id).any(axis=1)
                else:
                    has_end_think = np.zeros(B, dtype=bool)
                if not has_end_think.all():
                    if tokens_before_block < max_thinking_tokens:
                        offset = max_thinking_tokens - tokens_before_block
                    else:
                        offset = 0
                    inject_pos = current_block_start + offset
                    for b in range(B):
                        if not has_end_think[b]:
                            x_accum[b, inject_pos] = end_think_token_id

        mask_block_idx0 = x_accum[:, block] == mask_id
        num_transfer_tokens = _get_num_transfer_tokens(mask_block_idx0, steps_per_block)

        for i in range(steps_per_block):
            mask_block_idx = x_accum[:, block] == mask_id
            if mask_block_idx.sum() == 0:
                break
            nfe += 1
            logits, _ = model(x_accum[:, block], past_key_values=past_key_values, use_cache=False)
            x0, transfer_idx = _get_transfer_index(
                logits,
                0.0,
                mask_block_idx,
                x_accum[:, block],
                num_transfer_tokens[:, i],
                threshold,
                None,
            )
            cur = x_accum[:, block].copy()
            cur[transfer_idx] = x0[transfer_idx]
            x_accum[:, block] = cur

            if eos_token_id is not None:
                block_tokens = x_accum[:, block]
                eos_mask = block_tokens == eos_token_id
                any_eos = eos_mask.any(axis=1)
                if any_eos.any():
                    after_eos = np.cumsum(eos_mask, axis=1) > 0
                    mask_before = (block_tokens == mask_id) & ~after_eos
                    if (any_eos & ~mask_before.any(axis=1)).any():
                        break

        logits, past_key_values = model(
            x_accum[:, block],
            past_key_values=past_key_values,
            use_cache=True,
            use_causal_mask=causal_context,
        )
        nfe += 1
        if causal_context:
            next_token = np.argmax(logits[:, -1, :], axis=-1)[:, None]

        if eos_token_id is not None:
            is_eos = x_accum[:, prompt_len:] == eos_token_id
            if is_eos.any(axis=1).all():
                max_eos = int(is_eos.argmax(axis=1).max())
                return x_accum[:, : prompt_len + max_eos + 1], nfe
    return x_accum, nfe


def ar_generate(
    model, prompt, max_new_tokens, eos_token_id, max_thinking_tokens=None, end_think_token_id=None
):
    """A plain transcription of the remote code's `ar_generate` at temperature 0 (greedy, one row):
    from step max_thinking_tokens on, a row with no end_think_token_id so far gets it in place of
    its next token. Each step recomputes the causal forward over the whole sequence (the
    reference's KV cache computes the same logits). Returns the new tokens, the EOS included."""
    ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
    out = []
    for step in range(max_new_tokens):
        logits, _ = model(np.array([ids + out]), use_cache=True, use_causal_mask=True)
        token = int(np.argmax(logits[0, -1]))
        if end_think_token_id is not None and max_thinking_tokens is not None:
            if step >= max_thinking_tokens and end_think_token_id not in out:
                token = end_think_token_id
        out.append(token)
        if token == eos_token_id:
            break
    return out
