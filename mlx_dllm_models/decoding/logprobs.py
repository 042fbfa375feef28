"""Log-probabilities of tokens under a step's logits, and the best alternatives: what the
`logprobs` setting reports (engine.logprobs records them as the loops commit tokens).

The distribution is the model's own: the log-softmax of the logits the forward gave (float32,
after a family's logit suppression, which makes a token impossible), before temperature, top-k and
top-p, as mlx-lm and OpenAI report it. Ids that a loop never proposes at a position (the mask
token, a family's suppressed ids) keep their mass but are not listed as alternatives.
"""

from typing import Sequence, Tuple

import mlx.core as mx

_NEG_INF = float("-inf")


def log_probs(logits: mx.array) -> mx.array:
    """log_softmax over the last axis in float32, NaN-safe as decoding.stats: a NaN logit is
    -inf; a row without a finite logit is uniform (it is never committed from)."""
    logits = logits.astype(mx.float32)
    logits = mx.where(mx.isnan(logits), _NEG_INF, logits)
    finite = mx.any(logits > _NEG_INF, axis=-1, keepdims=True)
    safe = mx.where(finite, logits, 0.0)
    return safe - mx.logsumexp(safe, axis=-1, keepdims=True)


def token_log_probs(
    logp: mx.array, tokens: mx.array, k: int, never: Sequence[int] = ()
) -> Tuple[mx.array, mx.array, mx.array]:
    """(value, ids, top) of `tokens` (...,) under `logp` (..., V): each token's log-probability,
    and the ids (..., k) and log-probabilities (..., k) of the k most probable tokens, best first,
    leaving out the ids in `never`."""
    value = mx.take_along_axis(logp, tokens.astype(mx.int32)[..., None], axis=-1)[..., 0]
    if k == 0:
        shape = tuple(tokens.shape) + (0,)
        return value, mx.zeros(shape, mx.int32), mx.zeros(shape, mx.float32)
    ranked = logp
    if never:
        keep = mx.ones((logp.shape[-1],), dtype=mx.bool_)
        keep[mx.array(list(never))] = False
        ranked = mx.where(keep, logp, _NEG_INF)
    k = min(k, logp.shape[-1])
    ids = mx.argpartition(-ranked, kth=k - 1, axis=-1)[..., :k]
    top = mx.take_along_axis(ranked, ids, axis=-1)
    order = mx.argsort(-top, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return value, ids, mx.take_along_axis(top, order, axis=-1)
