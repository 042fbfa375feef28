"""What every decoding loop shares: the events it yields, how a row's new tokens become one, and
how a loop or a backend draws a token from logits with its own PRNG key."""

import copy
from dataclasses import dataclass
from typing import AbstractSet, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..decoding import token_stats
from ..errors import CheckpointError


@dataclass
class StepEvent:
    """One denoising step: the current generated region of every active row (masks included).
    `confidence` (same shape as `generated`, float32, lazy): the step's confidence in its
    proposal at each position of its window, NaN elsewhere (read at the positions the step
    commits, it is the confidence they were committed with); None unless the decoder's
    `step_confidence` is set (the masked, canvas and WeDLM decoders have one)."""

    rows: List[int]
    generated: mx.array  # (B, max_tokens), lazy: only evaluated by a consumer that looks
    block: tuple
    nfe: int
    confidence: Optional[mx.array] = None

    @property
    def canvas(self) -> List[List[int]]:
        return self.generated.tolist()


class TokenLogprob(NamedTuple):
    """A returned token's log-probability under the step that committed it (the `logprobs`
    setting; decoding.logprobs says which distribution), and the best alternatives there."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]  # (token, log-probability), most probable first


@dataclass
class BlockEvent:
    """A block was committed. `tokens[i]` are row `rows[i]`'s new tokens (cut before its EOS);
    `eos[i]` says the row met an EOS in this block; `finished[i]` that the row is done (EOS, or
    max_tokens reached); `logprobs[i]` (with the `logprobs` setting, else None) one TokenLogprob
    per token of `tokens[i]`. `confidence[i]` (a decoder that yields no StepEvent, with its
    `step_confidence` set: self-speculation; else None): each token's probability under the
    forward row that confirmed it."""

    rows: List[int]
    tokens: List[List[int]]
    eos: List[bool]
    finished: List[bool]
    nfe: int
    logprobs: Optional[List[List[TokenLogprob]]] = None
    confidence: Optional[List[List[float]]] = None


def block_event(
    rows: Sequence[int],
    tokens: Sequence[Sequence[int]],
    at_limit: Sequence[bool],
    eos: AbstractSet[int],
    nfe: int,
    logprobs: Optional[Sequence[Sequence[TokenLogprob]]] = None,
) -> BlockEvent:
    """The event of a committed block: each row's new `tokens` cut before its first EOS; a row is
    finished when it met an EOS or, with these tokens, reached max_tokens (`at_limit`).
    `logprobs`: each row's entries, one per token, cut with them."""
    emitted, hit, finished, kept = [], [], [], []
    for row, (toks, limit) in enumerate(zip(tokens, at_limit)):
        cut = next((i for i, t in enumerate(toks) if t in eos), None)
        hit.append(cut is not None)
        emitted.append(list(toks) if cut is None else list(toks[:cut]))
        finished.append(cut is not None or bool(limit))
        if logprobs is not None:
            kept.append(list(logprobs[row][: len(emitted[-1])]))
    return BlockEvent(
        list(rows), emitted, hit, finished, nfe, kept if logprobs is not None else None
    )


def placed(values: mx.array, offset: int, width: int) -> mx.array:
    """`values` (B, W) at columns [offset, offset + W) of a (B, width) float32 array of NaN,
    clipped to it: a step's per-position statistic over its window, placed in an event's view."""
    out = mx.full((values.shape[0], width), float("nan"), dtype=mx.float32)
    lo, hi = max(offset, 0), min(offset + values.shape[1], width)
    if hi > lo:
        out[:, lo:hi] = values[:, lo - offset : hi - offset].astype(mx.float32)
    return out


def check_finite(logits: mx.array, model) -> None:
    """Refuse to decode from non-finite logits: NaN or inf weights (a corrupt download or a bad
    conversion) would otherwise decode to garbage, the same token everywhere, with no warning.
    Each decoding loop calls it once, on its first forward's logits (one host sync)."""
    if mx.isfinite(logits).all().item():
        return
    where = getattr(model, "checkpoint_path", None)
    where = f"the checkpoint at {where}" if where else f"this {type(model).__module__} model"
    raise CheckpointError(
        f"the first forward of {where} gave NaN or infinite logits: its weights are corrupt (or "
        "overflow in this dtype); re-download or re-convert the checkpoint"
    )


def replaced(obj, **fields):
    """A shallow copy of `obj` with some attributes replaced: how a layout or a backend keeps only
    the surviving rows of a batch (the fields given are the per-row ones, already selected)."""
    out = copy.copy(obj)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def next_key(owner):
    """A fresh subkey of `owner.key`, which advances: each owner (a backend, a loop) keeps its own
    stream, so its draws do not depend on how many another one made."""
    owner.key, sub = mx.random.split(owner.key)
    return sub


def split_rows(keys: mx.array, num: int) -> List[mx.array]:
    """`num` fresh key arrays (B, 2) from per-row keys (B, 2): row b's keys are those a run of row
    b alone splits from its one key, so each row draws as it would alone."""
    parts = [mx.random.split(keys[b], num) for b in range(keys.shape[0])]
    return list(mx.stack(parts, axis=1))


def sample_tokens(logits, settings, spec, key, suppress=()):
    """Per-position token of the AR head (or a draft): argmax at temperature 0, else a sample of
    the processed distribution (temperature, top-k, top-p)."""
    greedy = settings.temperature == 0
    return token_stats(
        logits,
        temperature=settings.temperature,
        top_k=None if greedy else settings.top_k,
        top_p=None if greedy else settings.top_p,
        key=None if greedy else key,
        suppress_ids=suppress,
        order=spec.sampling_order,
    ).x0.astype(mx.int32)
