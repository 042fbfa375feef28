"""Statistics of the logits at each position: proposed token, its confidence, entropy.

Everything is computed in float32 and is NaN-safe: a NaN logit is treated as -inf, a row without any
finite logit gets confidence 0 and entropy +inf (so no rule ever prefers it).
"""

from typing import NamedTuple, Optional, Sequence

import mlx.core as mx

from .bd3lm import top_p_within

_NEG_INF = float("-inf")


class _Stats(NamedTuple):
    x0: mx.array  # (B, L) proposed token ids
    confidence: mx.array  # (B, L) probability of x0 (see `confidence` argument of token_stats)
    entropy: mx.array  # (B, L) entropy of the model distribution, in nats


class TokenStats(_Stats):
    """(x0, confidence, entropy), plus optional statistics that token_stats computes only when
    asked through `extras` (None otherwise). They are attributes, not tuple fields, so unpacking
    stays three-way.

    margin: top-1 minus top-2 probability of the processed distribution (Dream's topk_margin).
    processed_entropy: entropy of the processed (temperature / top-k / top-p) distribution (Dream's
    `entropy` alg ranks by its negative).
    softmax_confidence: the probability of x0 under the processed distribution computed as torch's
    softmax does, exp(s - max) / sum(exp(s - max)): near 1 it keeps the gap that exp(s - lse)
    loses once the gap is below the rounding of a large logsumexp (Open-dCoder's p2 ranks
    committed tokens whose probabilities all sit within 1e-6 of 1).
    raw_softmax_confidence: the same form over the model's own (unprocessed) logits (dllm's
    samplers rank F.softmax(logits) at x0, where several masks sit within 1e-6 of 1).
    """

    margin = None
    processed_entropy = None
    softmax_confidence = None
    raw_softmax_confidence = None


def filter_logits(logits: mx.array, top_k: Optional[int] = None, top_p: Optional[float] = None):
    """Top-k, then top-p (nucleus) filtering: removed tokens get -inf.

    Top-p drops a token when the mass of the tokens ranked before it already exceeds top_p (so the
    first token always stays), as the HF TopPLogitsWarper used by Dream and LLaDA2 does.
    """
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -top_k][..., None]
        logits = mx.where(logits < kth, _NEG_INF, logits)
    if top_p is not None and top_p < 1.0:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        drop_sorted = mass_before > top_p
        drop = mx.take_along_axis(drop_sorted, mx.argsort(order, axis=-1), axis=-1)
        logits = mx.where(drop, _NEG_INF, logits)
    return logits


def softmax_stats(logits):
    """(p, finite_row, entropy) of softmax(logits) over the last axis. A row without a finite
    logit has finite_row False, a uniform p and entropy +inf, so that no rule prefers it."""
    finite_row = mx.any(logits > _NEG_INF, axis=-1, keepdims=True)
    safe = mx.where(finite_row, logits, 0.0)
    logp = safe - mx.logsumexp(safe, axis=-1, keepdims=True)
    p = mx.exp(logp)
    entropy = -mx.sum(mx.where(p > 0, p * logp, 0.0), axis=-1)
    entropy = mx.where(finite_row[..., 0], entropy, float("inf"))
    return p, finite_row, entropy


def processed(logits, order, temperature, top_k, top_p) -> mx.array:
    """The logits after a family's processing steps, in its reference's `order`."""
    scores = logits
    for op in order:
        if op == "temperature":
            scores = scores / temperature if temperature > 0 else scores
        elif op == "top_k":
            scores = filter_logits(scores, top_k=top_k)
        elif op == "top_p":
            scores = filter_logits(scores, top_p=top_p)
        elif op == "top_p_within":  # BD3-LM's nucleus: stops before the token that crosses p
            scores = top_p_within(scores, top_p)
        else:
            raise ValueError(f"unknown logits processing step {op!r} in order={tuple(order)}")
    return scores


def without(logits, ids: Sequence[int]) -> mx.array:
    """`logits` with the columns of `ids` at -inf (never proposed, or not read): LLaDA's
    `logits[:, :, ids] = -inf` of logits_eos_inf and confidence_eos_eot_inf."""
    if not ids:
        return logits
    keep = mx.ones((logits.shape[-1],), dtype=mx.bool_)
    keep[mx.array(list(ids))] = False
    return mx.where(keep, logits, _NEG_INF)


def token_stats(
    logits: mx.array,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    key: Optional[mx.array] = None,
    suppress_ids: Sequence[int] = (),
    confidence: str = "raw",
    order: Sequence[str] = ("top_k", "top_p", "temperature"),
    extras: Sequence[str] = (),
    confidence_suppress_ids: Sequence[int] = (),
) -> TokenStats:
    """Propose a token per position and score it.

    x0: argmax at temperature 0; otherwise a sample from softmax(filtered_logits / temperature),
    drawn with the Gumbel-max trick (LLaDA's add_gumbel_noise is the same distribution) from `key`.
    Suppressed ids (e.g. the mask id, so that a committed position can never stay a mask) are never
    proposed, but keep their mass in the probabilities, as in the references.

    confidence="raw": softmax of the unprocessed logits at x0 (LLaDA generate.py: the Gumbel sample
    uses the temperature, the confidence does not). confidence="sampled": the probability of x0 under
    the processed distribution softmax(filtered / T) (Dream, LLaDA2, SDAR sample_tokens; at T=0 the
    filtered softmax).
    entropy: of softmax(logits), the model's own distribution (EB-Sampler).

    order: the order in which the processed distribution applies top-k, top-p and temperature (a
    family's reference order: Dream divides by the temperature, then top-p, then top-k; top-p
    depends on where the temperature comes). extras: names of optional statistics to compute, see
    TokenStats ("margin", "processed_entropy").
    confidence_suppress_ids: ids whose logit is -inf in the raw softmax the confidence reads, after
    the proposal is drawn (LLaDA's confidence_eos_eot_inf: a proposed EoT scores 0).
    """
    logits = logits.astype(mx.float32)
    logits = mx.where(mx.isnan(logits), _NEG_INF, logits)
    scores = processed(logits, order, temperature, top_k, top_p)
    proposal = without(scores, suppress_ids)
    if temperature > 0:
        if key is None:
            raise ValueError("sampling at temperature > 0 needs an explicit PRNG key")
        u = uniform(key, proposal.shape, low=1e-20)
        proposal = proposal - mx.log(-mx.log(u))
    x0 = mx.argmax(proposal, axis=-1)

    unknown = set(extras) - {
        "margin",
        "processed_entropy",
        "softmax_confidence",
        "raw_softmax_confidence",
    }
    if unknown:
        raise ValueError(f"unknown token statistic(s) {sorted(unknown)}")
    if confidence not in ("raw", "sampled"):
        raise ValueError(f"unknown confidence kind {confidence!r}")
    # The confidence reads one probability per position, exp(logit[x0] - logsumexp): no softmax
    # over the vocabulary is materialised for it, and the entropy (a pass over the vocabulary)
    # is computed only if a rule reads it (MLX evaluates what is used). The values are those of
    # the softmax's element at x0, bit for bit.
    base = _Normaliser(logits)
    raw = _Normaliser(without(logits, confidence_suppress_ids)) if confidence_suppress_ids else base
    # The processed distribution is the model's own when no processing step changed the logits
    # (temperature 0 without top-k / top-p): one normaliser serves both.
    proc = None
    if confidence == "sampled" or extras:
        proc = base if scores is logits else _Normaliser(scores)
    conf = (raw if confidence == "raw" else proc).at(x0)
    conf = mx.where(base.finite[..., 0], conf, 0.0)
    out = TokenStats(x0, conf, base.entropy())
    if "margin" in extras:
        p_proc = proc.probabilities()
        if p_proc.shape[-1] > 1:
            top2 = mx.topk(p_proc, 2, axis=-1)
            margin = mx.abs(top2[..., 0] - top2[..., 1])
        else:
            margin = p_proc[..., 0]
        out.margin = mx.where(base.finite[..., 0], margin, 0.0)
    if "processed_entropy" in extras:
        out.processed_entropy = proc.entropy()
    for name, norm in (("softmax_confidence", proc), ("raw_softmax_confidence", base)):
        if name in extras:
            setattr(out, name, mx.where(base.finite[..., 0], norm.softmax_at(x0), 0.0))
    return out


class _Normaliser:
    """softmax_stats's quantities of one set of logits, each built when asked and once: the
    log-normaliser, the probability at given ids, the full probabilities, the entropy."""

    def __init__(self, logits):
        self.finite = mx.any(logits > _NEG_INF, axis=-1, keepdims=True)
        self.safe = mx.where(self.finite, logits, 0.0)
        self.lse = mx.logsumexp(self.safe, axis=-1, keepdims=True)
        self._p = None

    def at(self, ids):
        return mx.exp(mx.take_along_axis(self.safe, ids[..., None], axis=-1) - self.lse)[..., 0]

    def softmax_at(self, ids):
        """The probability at `ids` in torch's softmax form, exp(s - max) / sum(exp(s - max))."""
        shifted = mx.exp(self.safe - self.safe.max(axis=-1, keepdims=True))
        at = mx.take_along_axis(shifted, ids[..., None], axis=-1)[..., 0]
        return at / shifted.sum(axis=-1)

    def probabilities(self):
        if self._p is None:
            self._logp = self.safe - self.lse
            self._p = mx.exp(self._logp)
        return self._p

    def entropy(self):
        p = self.probabilities()
        h = -mx.sum(mx.where(p > 0, p * self._logp, 0.0), axis=-1)
        return mx.where(self.finite[..., 0], h, float("inf"))


def uniform(key: mx.array, shape, low: float = 0.0) -> mx.array:
    """Uniform draws in [low, 1) of `shape` (B, ...) from one PRNG key (2,), or from a key per row
    (B, 2): row b's draws are then those a run of row b alone makes from its key, so a batch
    samples each row as it would be sampled alone."""
    if key.ndim == 1:
        return mx.random.uniform(low=low, high=1.0, shape=shape, key=key)
    one = (1, *shape[1:])
    rows = [mx.random.uniform(low=low, high=1.0, shape=one, key=key[b]) for b in range(shape[0])]
    return mx.concatenate(rows, axis=0)
