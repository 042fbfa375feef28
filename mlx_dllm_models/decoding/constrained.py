"""The commit rule of a constrained row (structured output: a JSON schema, regex or grammar).

A diffusion step proposes a token for every open position at once, each conditioned on masks where
its neighbours are still open; a grammar only says which tokens may follow a given prefix. So a
constrained row commits a left-to-right prefix of its open positions:

- the first open position always commits, with its best token among those the grammar allows
  after the row's committed tokens (the logits masked by the matcher's allowed set, then the
  family's own temperature / top-k / top-p draw): each step moves the row on by one token at least;
- each following open position commits in the same step while the family's own commit rule
  (threshold, quota, ...) commits it and its proposal is allowed after the tokens before it (the
  proposal itself, never a substitute: a position whose model proposal the grammar forbids waits
  for a forward that sees the tokens before it);
- the tokens the grammar forces next (a JSON key, a closing brace) are filled without a forward;
- EOS comes only where the grammar accepts, and must come where it can take nothing else; nothing
  is committed after it;
- the budget: a token commits only if the grammar can still be closed after it (and EOS fit)
  within the row's max_tokens (`completion`, a short greedy search); where the model's choice
  would leave no room, the closing tokens are committed instead. A row whose grammar cannot be
  closed within its budget at all ends with finish_reason "length" and a valid prefix.

The functions here are pure: the matcher (its state lives in the engine's loop, one per row) is
reached through the callables the engine passes.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx


def allowed_tokens(words: mx.array, vocab: int) -> mx.array:
    """(R, vocab) bool from llguidance's packed masks (R, ceil(vocab / 32)) of 32-bit words: token
    t is allowed when bit t % 32 of word t // 32 is set."""
    ids = mx.arange(vocab)
    bits = words.astype(mx.uint32)[:, ids // 32] >> (ids % 32).astype(mx.uint32)
    return (bits & 1) == 1


def mask_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """`logits` (R, V) with the tokens the grammar forbids at -inf."""
    return mx.where(allowed, logits, float("-inf"))


def commit_prefix(
    first: int,
    proposals: Sequence[int],
    passes: Sequence[bool],
    consume: Callable[[int], bool],
    eos: Callable[[int], bool],
) -> List[int]:
    """The tokens a constrained row commits at its open positions this step, left to right.
    `first`: the best allowed token at the first open position (already consumed by the caller's
    matcher); `proposals` / `passes`: the model's proposals at the following open positions and
    whether the family's commit rule commits each; `consume(token)` advances the row's matcher by
    `token` and says whether the grammar allowed it (a refused token leaves it unchanged); `eos`
    tells the EOS ids. Stops at the first position that does not pass, is refused, or follows an
    EOS."""
    out = [first]
    for token, ok in zip(proposals, passes):
        if eos(out[-1]) or not ok or not consume(token):
            break
        out.append(token)
    return out


def completion(matcher, limit: int, candidates: Sequence[int]) -> Optional[List[int]]:
    """Tokens that bring `matcher` to a state where the grammar accepts (EOS may follow), at most
    `limit` of them, or None when this search finds none; the matcher is left as it was.

    A greedy walk, not an exhaustive search (the tokens the grammar allows branch too widely): the
    forced tokens, else a candidate after which the grammar accepts, else the first candidate it
    allows, `candidates` in order of preference (closing quotes and brackets first: see
    structured.closing_candidates). It finds a completion of a JSON value, of a bounded regex, of
    most grammars; where it finds none, the budget cannot be guarded and the row may end with
    finish_reason "length"."""
    path: List[int] = []
    try:
        while len(path) <= limit:
            if matcher.is_accepting():
                return list(path)
            if matcher.is_stopped():
                return None
            forced = matcher.compute_ff_tokens()
            if forced:
                taken = matcher.try_consume_tokens(forced)
                path.extend(forced[:taken])
                if taken:
                    continue
            step = None
            for t in candidates:
                if matcher.try_consume_tokens([t]) == 1:
                    if matcher.is_accepting():
                        step = t
                        break
                    matcher.rollback(1)
            if step is None:
                for t in candidates:
                    if matcher.try_consume_tokens([t]) == 1:
                        step = t
                        break
            if step is None:
                return None
            path.append(step)
        return None
    finally:
        if path:
            matcher.rollback(len(path))
