"""Commit rules: which candidate positions take their proposed token this step.

Each rule takes (B, L) arrays and returns a (B, L) boolean commit mask that is a subset of
`candidates`. Every rule commits at least one position per row that still has a candidate (the
engine adds a per-step quota floor on top, which is what guarantees a block finishes in its steps).
"""

import mlx.core as mx

_NEG_INF = float("-inf")


# The last rank computed, with the arrays it was computed from (held, so that `is` cannot match
# a new array at a reused address): a step's rule ranks the same confidences twice (its own
# threshold / factor rule, then the schedule's quota floor) and gets the first rank back.
_last_rank = (None, None, None, None)


def _rank(scores: mx.array, candidates: mx.array, descending: bool = True) -> mx.array:
    """Rank of each position among the row's candidates (0 = best); non-candidates rank last.

    Ties (common once float32 probabilities saturate at 1.0) go to the lower position, so the
    outcome never depends on a sort's stability: rank_i = #{j better than i} + #{j < i tied with i}.
    Pairwise over the block, which is at most a few hundred positions.
    """
    global _last_rank
    last_scores, last_candidates, last_descending, last = _last_rank
    if scores is last_scores and candidates is last_candidates and descending == last_descending:
        return last
    key = scores if descending else -scores
    key = mx.where(candidates, key, _NEG_INF)
    a, b = key[..., :, None], key[..., None, :]  # a: position i, b: position j
    n = key.shape[-1]
    earlier = mx.arange(n)[None, :] < mx.arange(n)[:, None]  # [i, j]: j < i
    beats = (b > a) | ((b == a) & earlier)
    rank = beats.sum(axis=-1)
    _last_rank = (scores, candidates, descending, rank)
    return rank


def quota_commit(confidence: mx.array, candidates: mx.array, k) -> mx.array:
    """Commit the k most confident candidates of each row (LLaDA low-confidence remasking);
    k is an int or a (B,) array. Commits min(k, #candidates) per row, exactly."""
    k = mx.array(k)
    if k.ndim == 1:
        k = k[:, None]
    return candidates & (_rank(confidence, candidates) < k)


def threshold_commit(
    confidence: mx.array, candidates: mx.array, threshold: float, strict: bool = False
) -> mx.array:
    """Commit every candidate whose confidence reaches `threshold` (>=, or > when strict as in
    LLaDA2), and the most confident candidate in any case (Fast-dLLM get_transfer_index)."""
    passes = (confidence > threshold) if strict else (confidence >= threshold)
    return (candidates & passes) | quota_commit(confidence, candidates, 1)


def factor_commit(confidence: mx.array, candidates: mx.array, factor: float) -> mx.array:
    """Fast-dLLM's factor rule (get_transfer_index_dynamic): with candidates sorted by descending
    confidence c_1 >= c_2 >= ..., commit the longest prefix in which every n satisfies
    (n + 1) * (1 - c_n) <= factor; the first is always committed. The reference's off-by-one (it
    also commits the first failing candidate when that is the last one) is left out."""
    rank = _rank(confidence, candidates)
    n = (rank + 1).astype(mx.float32)
    ok = ((n + 1) * (1 - confidence) <= factor) | (rank == 0)
    ok = ok & candidates
    # Longest prefix in rank order: a position passes if every better-ranked candidate passes.
    order = mx.argsort(rank, axis=-1)
    ok_sorted = mx.take_along_axis(ok, order, axis=-1)
    prefix_sorted = mx.cumprod(ok_sorted.astype(mx.int32), axis=-1).astype(mx.bool_)
    prefix = mx.take_along_axis(prefix_sorted, mx.argsort(order, axis=-1), axis=-1)
    return prefix & candidates


def entropy_commit(entropy: mx.array, candidates: mx.array, bound: float) -> mx.array:
    """EB-Sampler: sort candidates by ascending entropy and commit the longest prefix whose
    entropies before the last one sum to at most `bound` (sum_{j<i} H_j <= bound): at least one."""
    rank = _rank(entropy, candidates, descending=False)
    order = mx.argsort(rank, axis=-1)
    h_sorted = mx.take_along_axis(mx.where(candidates, entropy, 0.0), order, axis=-1)
    before = mx.cumsum(h_sorted, axis=-1) - h_sorted
    ok_sorted = before <= bound
    ok = mx.take_along_axis(ok_sorted, mx.argsort(order, axis=-1), axis=-1)
    # The lowest entropy always commits: quota_commit(-entropy, candidates, 1), from this rank.
    return (ok | (rank < 1)) & candidates


def edit_commit(
    x0: mx.array,
    confidence: mx.array,
    tokens: mx.array,
    editable: mx.array,
    threshold: float,
    strict: bool = True,
) -> mx.array:
    """Token editing (LLaDA2.1 T2T): rewrite an already committed, editable position whose proposal
    differs from its token with confidence above `threshold`. No edit is ever forced."""
    passes = (confidence > threshold) if strict else (confidence >= threshold)
    return editable & passes & (x0 != tokens)
