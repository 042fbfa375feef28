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

`linear_spec_generate(...)` transcribes the remote code's self-speculation with its
`linear_spec_lora` draft adapter; mlx-vlm's model has no adapter, so its forwards are this
package's model (`OurForward`, whose forward tests/test_nemotron_forward.py checks against
mlx-vlm's) with the adapter switched as the remote code switches its LoRA.
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

            if _eos_without_mask_before(x_accum[:, block], eos_token_id, mask_id):
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


def _eos_without_mask_before(block_tokens, eos_token_id, mask_id):
    """Whether some row of the block has an EOS with no mask before it (the block loop's exit)."""
    eos_mask = block_tokens == eos_token_id
    any_eos = eos_mask.any(axis=1)
    if any_eos.any():
        after_eos = np.cumsum(eos_mask, axis=1) > 0
        mask_before = (block_tokens == mask_id) & ~after_eos
        if (any_eos & ~mask_before.any(axis=1)).any():
            return True
    return False


def _inject_end_think(
    x_accum, prompt_len, num_block, block_length, max_thinking_tokens, end_think_token_id
):
    """The thinking budget at block `num_block`: rows with no end_think_token_id among the earlier
    blocks' tokens get it at offset max(0, max_thinking_tokens - tokens before the block)."""
    B = x_accum.shape[0]
    current_block_start = prompt_len + num_block * block_length
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
            _inject_end_think(
                x_accum, prompt_len, num_block, block_length, max_thinking_tokens,
                end_think_token_id,
            )  # fmt: skip

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
                if _eos_without_mask_before(x_accum[:, block], eos_token_id, mask_id):
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


class _DynamicCacheLayer:
    """One layer of HF's DynamicCache as the remote code uses it: K/V grow by concatenation; a
    forward with `use_cache=False` reads the stored K/V and its own but stores nothing."""

    def __init__(self):
        self.keys = self.values = None
        self.store = True

    @property
    def offset(self):
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        if self.store:
            self.keys, self.values = keys, values
        return keys, values

    def crop(self, length):
        self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


class DynamicCache(list):
    """HF's DynamicCache over this package's Nemotron model: `get_seq_length()` and `crop(n)`."""

    def __init__(self, num_layers):
        super().__init__(_DynamicCacheLayer() for _ in range(num_layers))

    def get_seq_length(self):
        return self[0].offset

    def crop(self, length):
        for layer in self:
            layer.crop(length)


class OurForward:
    """The HF calls `model(ids, past_key_values, use_cache, use_causal_mask)` on this package's
    Nemotron model (its forward is checked against mlx-vlm's in tests/test_nemotron_forward.py, in
    both attention modes and over a causal prefix cache), with a DynamicCache of its own (the model
    sees no mlx-lm cache, so no mask means every key: [cache ; block] bidirectionally).
    `toggle_adapters(enable)` is the remote code's `_toggle_adapters` (PEFT's `_disable_adapters`):
    the checkpoint's linear_spec_lora switched on or off; a no-op without one."""

    def __init__(self, model):
        self.model = model

    def toggle_adapters(self, enable):
        if getattr(self.model, "has_draft_adapter", False):
            self.model.set_draft_adapter(enable)

    def __call__(self, ids, past_key_values=None, use_cache=False, use_causal_mask=False):
        if past_key_values is None:
            past_key_values = DynamicCache(len(self.model.layers))
        for layer in past_key_values:
            layer.store = use_cache
        out = self.model(
            mx.array(np.asarray(ids), dtype=mx.int32),
            cache=past_key_values,
            mask="causal" if use_causal_mask else None,
        )
        return np.array(out.astype(mx.float32), dtype=np.float64), past_key_values


def _draft_block(model, block, past_key_values, token_mask_id, threshold):
    """linear_spec_generate's draft phase, in place on `block`: at threshold 0 one forward fills
    every mask, else each forward reveals the masks at confidence >= threshold (at least the most
    confident one). Returns (draft forwards, whether a mask was drafted as the mask id)."""
    draft_forwards, drafted_mask = 0, False
    while True:
        is_mask = block == token_mask_id
        if not is_mask.any():
            break
        draft_logits, _ = model(block, past_key_values=past_key_values, use_cache=False)
        draft_forwards += 1
        draft_tokens = np.argmax(draft_logits, axis=-1)
        draft_probs = _softmax(draft_logits)
        drafted_mask |= bool((draft_tokens[is_mask] == token_mask_id).any())

        if threshold > 0:
            draft_conf = np.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
            draft_conf = np.where(is_mask, draft_conf, -np.inf)
            unmask = draft_conf >= threshold
            # Force progress even when every masked position is below threshold.
            if not unmask.any():
                best_idx = int(draft_conf.reshape(-1).argmax())
                unmask = np.zeros_like(is_mask, dtype=bool)
                unmask.reshape(-1)[best_idx] = True
            block[unmask] = draft_tokens[unmask]
        else:
            block[is_mask] = draft_tokens[is_mask]
            break
    return draft_forwards, drafted_mask


def _accepted_length(ar_tokens, block, block_length):
    """Accept consecutive matches; AR also gives one bonus token at the tail."""
    accepted = 0
    for i in range(block_length - 1):
        if int(ar_tokens[0, i]) == int(block[0, i + 1]):
            accepted += 1
        else:
            break
    accepted += 1
    return accepted


def linear_spec_generate(
    model,
    prompt_ids,
    max_new_tokens,
    block_length,
    mask_token_id,
    eos_token_id,
    threshold=0.0,
    trace=None,
):
    """A plain transcription of the remote code's `NemotronLabsDiffusionModel.linear_spec_generate`
    (modeling_nemotron_labs_diffusion.py) at temperature 0, one row, no thinking budget. `model` is
    an `OurForward`. Causal prefill with the LoRA off gives the first token; each round drafts the
    block [next_token, masks] bidirectionally against the cache (use_cache=False) with the LoRA on,
    once at threshold 0, else repeatedly, each forward revealing the masks whose softmax confidence
    is >= threshold (at least the most confident one); verifies it causally with the LoRA off
    (use_cache=True); keeps the AR tokens up to the first draft the AR model disagrees with, plus
    its own next one; crops the cache to the kept K/V; next_token is the last kept token. Stops at
    an EOS among the kept tokens (cut after it) or once max_new_tokens are reached, which the last
    round may pass (the reference returns them all). Returns (ids including the prompt, nfe).

    `trace`, a list, gets one (draft forwards, accepted tokens, drafted the mask id) per round (test
    instrumentation, not in the reference).

    NVIDIA's MinistralDiffEncoderModel (modeling_ministral_dlm.py) carries an older
    linear_spec_generate: no LoRA toggle, one draft forward whose masks above `threshold` (strict)
    are revealed, an AssertionError when none is; the Nemotron-Labs-Diffusion one is transcribed."""
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    if prompt_ids.shape[0] != 1:
        raise ValueError("Linear speculative decoding requires batch_size == 1")
    token_mask_id = mask_token_id

    # Prefill (causal, LoRA OFF).
    model.toggle_adapters(False)
    logits, past_key_values = model(prompt_ids, use_cache=True, use_causal_mask=True)
    last_logit = logits[:, -1, :]
    nfe = 1
    next_token = np.argmax(last_logit, axis=-1)[:, None]
    if eos_token_id is not None and int(next_token[0, 0]) == eos_token_id:
        return np.concatenate([prompt_ids, next_token], axis=1), nfe

    generated = [next_token]
    total_gen = 1

    while total_gen < max_new_tokens:
        cache_len = past_key_values.get_seq_length()

        block = np.full((1, block_length), token_mask_id, dtype=np.int64)
        block[0, 0] = int(next_token[0, 0])

        # Draft phase (bidirectional, LoRA ON), iterated at threshold > 0.
        model.toggle_adapters(True)
        draft_forwards, drafted_mask = _draft_block(
            model, block, past_key_values, token_mask_id, threshold
        )
        nfe += draft_forwards

        # Verify phase (causal, LoRA OFF).
        model.toggle_adapters(False)
        verify_logits, past_key_values = model(
            block, past_key_values=past_key_values, use_cache=True, use_causal_mask=True
        )
        nfe += 1
        ar_tokens = np.argmax(verify_logits, axis=-1)

        accepted = _accepted_length(ar_tokens, block, block_length)

        accepted_toks = ar_tokens[:, :accepted]
        generated.append(accepted_toks)
        total_gen += accepted
        if trace is not None:
            trace.append((draft_forwards, accepted, drafted_mask))

        past_key_values.crop(cache_len + accepted)
        next_token = ar_tokens[:, accepted - 1 : accepted]

        if eos_token_id is not None:
            eos_pos = np.nonzero(accepted_toks[0] == eos_token_id)[0]
            if len(eos_pos) > 0:
                first_eos = int(eos_pos[0])
                generated[-1] = accepted_toks[:, : first_eos + 1]
                total_gen = total_gen - accepted + first_eos + 1
                break

        if total_gen >= max_new_tokens:
            break

    all_generated = np.concatenate(generated, axis=1)
    return np.concatenate([prompt_ids, all_generated], axis=1), nfe
