"""BD3-LM's nucleus (kuleshov-group/bd3lms, diffusion.py `_nucleus_sample`) as a pure rule on
logits: the `top_p_within` step of a family's sampling_order (decoding.stats.token_stats).

Upstream sorts the probabilities, keeps the tokens whose cumulative probability, their own
included, is at most p (the most probable one always), and renormalises. The HF rule that
`top_p` follows elsewhere (stats.filter_logits) also keeps the token that crosses p; this one
stops before it, so its nucleus is one token smaller wherever p falls inside a token's mass.
Removed tokens get -inf, which is the renormalised distribution in logit form.
"""

import mlx.core as mx

_NEG_INF = float("-inf")


def top_p_within(logits: mx.array, top_p) -> mx.array:
    """(..., V) logits with every token outside BD3-LM's nucleus at -inf; top_p None or >= 1
    keeps every token (upstream returns p_x0 unchanged at nucleus_p == 1)."""
    if top_p is None or top_p >= 1.0:
        return logits
    order = mx.argsort(-logits, axis=-1)
    probs = mx.softmax(mx.take_along_axis(logits, order, axis=-1), axis=-1)
    keep_sorted = mx.cumsum(probs, axis=-1) <= top_p
    keep_sorted[..., 0] = True
    keep = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
    return mx.where(keep, logits, _NEG_INF)
