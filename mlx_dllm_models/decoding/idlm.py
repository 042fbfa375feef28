"""I-DLM's Introspective Strided Decoding rule (thuEcstasy/I-DLM, inference/sglang/sglang/srt/dllm/
algorithm/idlm_blockN.py, `IDLMBlockN.run`), as pure functions of one forward's logits.

A forward is causal over [pending token, its drafts, N - 1 masks]; logits at a row predict the token
after it. The rows of the pending token and the drafts verify the drafts (the clean distributions
p); the last of them gives the round's clean token; the mask rows' argmaxes are the next drafts, and
their tempered softmaxes are the draft distributions q the next round's verification divides by.
"""

import mlx.core as mx


def draft_tokens(mask_logits: mx.array) -> mx.array:
    """The next round's drafts: the argmax of each mask row. IDLMBlockN never samples a draft, at
    any temperature (only the clean position is sampled), and keeps the mask id among the
    candidates."""
    if mask_logits.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.int32)
    return mx.argmax(mask_logits, axis=-1).astype(mx.int32)


def draft_distributions(mask_logits: mx.array, temperature: float) -> mx.array:
    """q: softmax(logits / temperature) of the mask rows, unfiltered (IDLMBlockN stores the
    tempered draft logits; its verify kernel takes their softmax)."""
    return mx.softmax(mask_logits.astype(mx.float32) / temperature, axis=-1)


def target_distributions(verify_logits: mx.array, temperature: float, clean: mx.array) -> mx.array:
    """p for speculative acceptance over k drafts: rows 0..k-1 softmax(logits / temperature),
    unfiltered (IDLMBlockN's verify: the ratio p/q and the residual max(0, p - q)), then `clean`,
    the processed (top-k / top-p) distribution of row k, which the clean token is drawn from when
    every draft is kept."""
    k = verify_logits.shape[0] - 1
    rows = mx.softmax(verify_logits[:k].astype(mx.float32) / temperature, axis=-1)
    return mx.concatenate([rows, clean.reshape(1, -1)])
