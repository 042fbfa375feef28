"""Causal-prefix decoding (Nemotron-Labs-Diffusion): AR-seeded diffusion blocks over a causal KV
prefix, and lossless self-speculation.

Diffusion mode (the HF remote code's `generate` with causal_context=True): a causal prefill of the
prompt fills the KV cache and gives the AR head's next token, which seeds position 0 of the first
block; the rest of the block is denoised bidirectionally against the cache, which it reads but never
extends; then one causal forward over the finished block writes its K/V and gives the next block's
seed. That forward runs when the next block begins, so none is spent after the last block or after
every row met an EOS. The cache (cache.PrefixKVCache) is preallocated: every forward writes its K/V
in place and reads the prefix as a slice, never a per-step concatenation.

`cache="none"` is the same decoding by full recompute (each forward over the whole sequence under
masks.causal_prefix_mask), the exact reference mode that the cache must reproduce token for token.

Self-speculation (the HF `linear_spec_generate`): a window of masks after the confirmed tokens is
drafted bidirectionally, one causal pass verifies the drafts, the longest prefix that the causal
model agrees with is kept plus its own next token, and the cache is cut back to what was kept. The
next window is drafted in the same forward as the verify (see SelfSpeculativeDecoder). At
temperature 0 the output is greedy AR decoding, token for token; above it, drafts are accepted by
speculative sampling (keep d with probability min(1, p(d)/q(d)), else resample from max(0, p - q)),
so the output keeps the AR model's distribution, which the reference's comparison of two samples
does not.
"""

from typing import List, Sequence

import mlx.core as mx

from ..cache import PrefixKVCache, Positions
from ..decoding import filter_logits, token_stats
from ..engine import BACKENDS, DECODERS, BlockEvent
from ..masks import causal_prefix_mask
from ..spec import CAUSAL_PREFIX


def _next_key(owner):
    owner.key, sub = mx.random.split(owner.key)
    return sub


def _sample(logits, settings, spec, key, suppress=()):
    """Per-position token of the AR head (or a draft): argmax at temperature 0, else a sample of
    the processed distribution (temperature, top-k, top-p)."""
    greedy = settings["temperature"] == 0
    return token_stats(
        logits,
        temperature=settings["temperature"],
        top_k=None if greedy else settings["top_k"],
        top_p=None if greedy else settings["top_p"],
        key=None if greedy else key,
        suppress_ids=suppress,
        order=spec.sampling_order,
    ).x0.astype(mx.int32)


class _Forwards:
    """Forwards over columns start..stop-1 of a (B, W) token array whose queries before `split`
    attend causally and whose queries from `split` on attend to every key before stop (a causal
    part, then a bidirectional window); subclasses differ in how (a KV cache, or full recompute).
    `causal` leaves the K/V of its columns final; `keep(column)` says which K/V are final after a
    forward whose causal part was only partly kept."""

    def causal(self, x, start, stop, rows=None):
        out = self.mixed(x, start, stop, stop, rows)
        self.keep(stop)
        return out

    def bidirectional(self, x, start, stop):
        return self.mixed(x, start, start, stop)


class _KVForwards(_Forwards):
    def __init__(self, model, width, pads):
        self.model, self.pads = model, pads
        self.cache = PrefixKVCache(len(model.layers), width, pads)

    def mixed(self, x, start, split, stop, rows=None):
        if self.pads is not None or start < split < stop:
            mask = causal_prefix_mask(stop - start, split, offset=start, left_padding=self.pads)
        else:
            # With this package's cache, no mask attends to every key.
            mask = "causal" if split == stop else None
        return self.model(x[:, start:stop], cache=self.cache.at(start), mask=mask, rows=rows)

    def keep(self, column):
        # A causal part wrote K/V past what was kept: those columns are rewritten later.
        self.cache.committed = column

    def select(self, idx, pads):
        out = object.__new__(type(self))
        out.model, out.pads = self.model, pads
        out.cache = self.cache.select(idx, pads)
        return out


class _RecomputeForwards(_Forwards):
    def __init__(self, model, width, pads):
        self.model, self.pads = model, pads
        self.positions = Positions.for_left_padding(pads or [0], len(model.layers))

    def mixed(self, x, start, split, stop, rows=None):
        mask = causal_prefix_mask(stop, split, left_padding=self.pads)
        rows = (start, stop) if rows is None else (start + rows[0], start + rows[1])
        return self.model(x[:, :stop], cache=self.positions, mask=mask, rows=rows)

    def keep(self, column):
        pass

    def select(self, idx, pads):
        return type(self)(self.model, 0, pads)


class CausalPrefixCache:
    """Backend of the masked block engine (see engine.FullRecompute for the interface): blocks
    seeded by the AR head and denoised against a causal KV prefix."""

    forwards = _KVForwards

    def __init__(self, model, spec, layout, settings):
        if layout.aligned or len(set(layout.starts)) != 1:
            raise ValueError("causal-prefix decoding needs blocks counted from the prompts' end")
        self.model, self.spec, self.settings = model, spec, settings
        self.pads = list(layout.pads) if any(layout.pads) else None
        self.fwd = self.forwards(model, layout.width, self.pads)
        self.prompt_end = layout.starts[0]
        self.generated = layout.generated
        self.key = mx.random.split(mx.random.key(settings["seed"]))[1]
        self.seed = None  # (B,) the AR head's token for the next block's first position
        self.pending = None  # the finished block whose causal forward has not run yet
        self.nfe = 0

    def _seed_after(self, x, start, stop):
        self.nfe += 1
        logits = self.fwd.causal(x, start, stop, rows=(stop - start - 1, stop - start))
        self.seed = _sample(logits[:, -1], self.settings, self.spec, _next_key(self))

    def prefill(self, x):
        self._seed_after(x, 0, self.prompt_end)

    def begin_block(self, x, start, stop):
        if self.pending is not None:
            self._seed_after(x, *self.pending)
            self.pending = None
        x[:, start] = mx.where(self.generated[:, start], self.seed, x[:, start])
        return x

    def block_logits(self, x, start, stop):
        self.nfe += 1
        return self.fwd.bidirectional(x, start, stop)

    def end_block(self, x, start, stop):
        self.pending = (start, stop)

    def select(self, layout, idx: List[int]):
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.pads = list(layout.pads) if any(layout.pads) else None
        out.fwd = self.fwd.select(idx, out.pads)
        out.generated = layout.generated
        out.seed = None if self.seed is None else self.seed[mx.array(idx)]
        return out


class CausalPrefixRecompute(CausalPrefixCache):
    """The same decoding by full recompute: the reference mode the cache must reproduce."""

    forwards = _RecomputeForwards


BACKENDS[(CAUSAL_PREFIX, "auto")] = CausalPrefixCache
BACKENDS[(CAUSAL_PREFIX, "prefix")] = CausalPrefixCache
BACKENDS[(CAUSAL_PREFIX, "none")] = CausalPrefixRecompute


# ------------------------------------------------------------------------- self-speculation


def _probs(logits, settings, spec, suppress=()):
    """The processed distribution that `_sample` draws from (float32, (..., V))."""
    scores = logits.astype(mx.float32)
    for op in spec.sampling_order:
        if op == "temperature":
            scores = scores / settings["temperature"]
        elif op == "top_k":
            scores = filter_logits(scores, top_k=settings["top_k"])
        elif op == "top_p":
            scores = filter_logits(scores, top_p=settings["top_p"])
    if suppress:  # after the filters, as token_stats does
        scores[..., mx.array(list(suppress))] = float("-inf")
    return mx.softmax(scores, axis=-1)


def _draw(weights, key):
    """A token drawn in proportion to non-negative `weights` (zero weight: never drawn)."""
    logw = mx.where(weights > 0, mx.log(mx.maximum(weights, 1e-38)), float("-inf"))
    return mx.random.categorical(logw, key=key)


def speculative_accept(p, q, drafts, key) -> List[int]:
    """Speculative sampling of one row (Leviathan et al. 2023; Chen et al. 2023): `drafts` (k,)
    were drawn from q (k, V); p (k + 1, V) are the target's distributions at the draft positions
    and one past. Returns a prefix of the drafts, each kept with probability min(1, p/q), then one
    token from the residual max(0, p - q) at the first rejection, or from p[k] when every draft is
    kept: every returned token is distributed as the target's."""
    k = len(drafts)
    k_u, k_tok = mx.random.split(key)
    n = k
    if k:
        d = mx.array(drafts)[:, None]
        pd = mx.take_along_axis(p[:k], d, axis=-1)[:, 0]
        qd = mx.take_along_axis(q, d, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(k,), key=k_u)
        n = next((i for i, ok in enumerate((u * qd < pd).tolist()) if not ok), k)
    last = _draw(mx.maximum(p[n] - q[n], 0.0), k_tok) if n < k else _draw(p[k], k_tok)
    return list(drafts[:n]) + [int(last.item())]


class SelfSpeculativeDecoder:
    """`mode="self_spec"`: lossless self-speculative decoding (the HF `linear_spec_generate`), one
    prompt at a time.

    Every forward has two parts. A causal part over the tokens whose K/V are not final yet (the
    last confirmed token, then the pending drafts) verifies the drafts: those the causal model
    agrees with are kept, plus its own next token, and the cache keeps the K/V of what was kept. A
    window of block_length masks after them, attending bidirectionally to everything before it and
    to itself, drafts the next round's tokens. Those drafts assume that every pending draft is kept;
    when one is rejected they are dropped, and the next forward verifies nothing and drafts afresh
    after the corrected token. The reference spends one draft forward and one verify forward per
    round; folding the next draft into the verify gives at least one token per forward (as AR
    decoding does) and the accepted drafts on top.

    Rows of a batch run one after another: their accepted lengths differ every round, so their
    caches would not stay aligned.
    """

    def __init__(self, model, settings: dict, eos_token_ids: Sequence[int], backend=None):
        self.model = model
        self.spec = model.diffusion_spec
        self.s = settings
        self.eos = set(int(e) for e in eos_token_ids)
        self.forwards = _RecomputeForwards if settings.get("cache") == "none" else _KVForwards
        self.key = mx.random.split(mx.random.key(settings["seed"]))[1]
        self.nfe = 0
        self.drafted = 0  # drafts verified
        self.accepted = 0  # drafts kept

    def run(self, prompts: Sequence[Sequence[int]]):
        for row, prompt in enumerate(prompts):
            yield from self._run_row(row, [int(t) for t in prompt])

    def _tokens(self, logits, suppress=()):
        return _sample(logits, self.s, self.spec, _next_key(self), suppress).tolist()

    def _run_row(self, row, prompt):
        s, spec = self.s, self.spec
        mask_id, max_tokens, window = spec.mask_token_id, s["max_tokens"], s["block_length"]
        greedy = s["temperature"] == 0
        x = mx.array([prompt + [mask_id] * max_tokens], dtype=mx.int32)
        run = self.forwards(self.model, x.shape[1], None)
        committed = 0  # columns before it have final K/V
        known = len(prompt)  # columns before it hold confirmed tokens
        drafts, q = [], None  # drafts of the columns from `known` on, and their distributions
        made = 0
        while made < max_tokens:
            left = max_tokens - made
            drafts = drafts[: left - 1]  # a round returns the kept drafts and one token more
            k = len(drafts)
            w = min(window, left - k - 1)  # the next round's column of t, then its drafts
            w = w if w >= 2 else 0
            split, stop = known + k, known + k + w
            if k:
                x[:, known:split] = mx.array(drafts, dtype=mx.int32)
            if w:
                x[:, split:stop] = mask_id
            self.nfe += 1
            rows = (known - 1 - committed, stop - committed)
            logits = run.mixed(x, committed, split, stop, rows=rows)[0]
            verify, window_logits = logits[: k + 1], logits[k + 2 :]
            if greedy:
                ar = self._tokens(verify)
                n = next((i for i in range(k) if ar[i] != drafts[i]), k)
                new = drafts[:n] + [ar[n]]
            else:
                p = _probs(verify, s, spec)
                new = speculative_accept(p, q, drafts, _next_key(self))
                n = len(new) - 1
            self.drafted += k
            self.accepted += n
            x[:, known + n] = new[-1]
            committed, known = known + n, known + n + 1
            run.keep(committed)
            if n == k and w:
                drafts = self._tokens(window_logits, suppress=(mask_id,))
                q = None if greedy else _probs(window_logits, s, spec, suppress=(mask_id,))
            else:
                drafts, q = [], None
            made += len(new)
            cut = next((i for i, t in enumerate(new) if t in self.eos), None)
            done = cut is not None or made >= max_tokens
            yield BlockEvent([row], [new if cut is None else new[:cut]], [cut is not None], [done],
                             self.nfe)
            if done:
                return


DECODERS["self_spec"] = SelfSpeculativeDecoder
