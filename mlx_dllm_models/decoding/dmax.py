"""DMax's soft parallel decoding (czg1225/DMax, dInfer/python/dinfer/decoding/parallel_strategy.py:
`get_transfer_index_uniform` and `ThresholdParallelDecoder.decode_uniform`), as pure rules on
(B, L) arrays of one block; the loop that runs them is engine/dmax.py.

Each step reads, at every position of the block, the most probable token and its probability
(float32 softmax of the logits). The block's decoded positions always take the step's most probable
token; among its masks, those left of the first one below `threshold` are committed, at least the
leftmost. Decoded positions enter the next forward as a soft embedding: the token's and the mask's
embeddings mixed by the token's probability, rescaled to the mixed norm of the two.
"""

import mlx.core as mx

# decode_uniform stops a block's iterations once every position it decodes is proposed at least
# this probable (its literal 0.9, independent of the threshold setting).
DMAX_SETTLED_PROBABILITY = 0.9


def best_tokens(logits: mx.array):
    """(token, probability) of each position: the argmax and its float32 softmax probability
    (`_get_prob_stats` at temperature 0)."""
    logits = logits.astype(mx.float32)
    token = mx.argmax(logits, axis=-1)
    chosen = mx.take_along_axis(logits, token[..., None], axis=-1)[..., 0]
    return token, mx.exp(chosen - mx.logsumexp(logits, axis=-1))


def prefix_commit(probability: mx.array, masks: mx.array, threshold: float) -> mx.array:
    """(B, L) the masks this step commits: those before the first mask proposed below
    `threshold`, or the leftmost mask when that is the first (get_transfer_index_uniform)."""
    low = masks & (probability < threshold)
    failed = mx.cumsum(low.astype(mx.int32), axis=-1) > 0
    chosen = masks & ~failed
    leftmost = masks & (mx.cumsum(masks.astype(mx.int32), axis=-1) == 1)
    return mx.where(chosen.any(axis=-1, keepdims=True), chosen, leftmost)


def settled(probability: mx.array, active: mx.array, changed: mx.array) -> bool:
    """Whether the block's iterations end after this step: every decoded position is proposed at
    DMAX_SETTLED_PROBABILITY or above, or the step changed no token (one host read)."""
    confident = mx.all(mx.where(active, probability >= DMAX_SETTLED_PROBABILITY, True))
    return bool((confident | ~changed.any()).item())


def soft_embeddings(
    probability: mx.array, token_embeddings: mx.array, mask_embedding: mx.array
) -> mx.array:
    """(B, L, H) p * e(token) + (1 - p) * e(mask), rescaled to the norm p |e(token)| +
    (1 - p) |e(mask)| (decode_uniform's top-1 mix; 1e-6 keeps a zero mix finite)."""
    p = probability.astype(mx.float32)[..., None]
    token = token_embeddings.astype(mx.float32)
    mask = mask_embedding.astype(mx.float32)
    rest = mx.maximum(1.0 - p, 0.0)
    mixed = token * p + mask * rest
    target = mx.linalg.norm(token, axis=-1, keepdims=True) * p
    target = target + mx.linalg.norm(mask, axis=-1, keepdims=True) * rest
    scaled = mixed * (target / (mx.linalg.norm(mixed, axis=-1, keepdims=True) + 1e-6))
    return scaled.astype(token_embeddings.dtype)
