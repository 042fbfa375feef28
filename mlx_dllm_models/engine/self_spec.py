"""Lossless self-speculation (Nemotron-Labs-Diffusion's `mode="self_spec"`, the HF
`linear_spec_generate`): a window of masks after the confirmed tokens is drafted bidirectionally, one
causal pass verifies the drafts, the longest prefix that the causal model agrees with is kept plus
its own next token, and the cache is cut back to what was kept. The next window is drafted in the
same forward as the verify (see SelfSpeculativeDecoder). At temperature 0 the output is greedy AR
decoding, token for token; above it, drafts are accepted by speculative sampling (keep d with
probability min(1, p(d)/q(d)), else resample from max(0, p - q)), so the output keeps the AR model's
distribution, which the reference's comparison of two samples does not.

With the checkpoint's `linear_spec_lora` draft adapter (models/nemotron_labs_diffusion.py), rounds
run as the reference's `linear_spec_generate` with its LoRA: the block [last confirmed token, masks]
is drafted bidirectionally against the causal prefix with the adapter on, then verified by a causal
forward over the block with it off. The two cannot share a forward (they run different weights), so
a round takes two; the output is still the adapter-off AR model's, token for token at temperature 0.

The thinking budget (`max_thinking_tokens` / `end_think_token_id`) is the remote code's
`ar_generate`'s: a row that has not produced end_think_token_id among its first max_thinking_tokens
new tokens gets it as new token number max_thinking_tokens, so the output stays that of AR decoding
(with the budget), token for token at temperature 0. A round that reaches that position keeps what
precedes it and the marker, and drops the rest (the next round drafts after the marker).
`linear_spec_generate` takes the same two arguments but only feeds the marker to the next round in
place of the last accepted token, which stays in its output: its output never shows the marker, and
no longer is what the model was conditioned on.

The rows of a batch share every forward, in both kinds of round: their accepted lengths differ
every round, so each row's tokens and K/V sit at columns of its own (SelfSpeculativeDecoder). A row
leaves when it finishes or is cancelled, and the server restarts a run over [prompt ; returned
tokens] to take in rows that arrive meanwhile (`joins_exactly`).
"""

from typing import AbstractSet, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..decoding import threshold_commit
from ..decoding.constrained import mask_logits
from ..decoding.stats import processed, without
from .base import block_event, check_finite, next_key, sample_tokens
from .constrained import TokenSequenceConstraint
from .contracts import Decoder, DecoderInputs
from .logprobs import entries


def processed_probs(logits, settings, spec, suppress=()):
    """The processed distribution that `sample_tokens` draws from (float32, (..., V)), at
    temperature > 0: token_stats' processing steps in the spec's order, then the suppressed ids."""
    s = settings
    scores = processed(
        logits.astype(mx.float32), spec.sampling_order, s.temperature, s.top_k, s.top_p
    )
    return mx.softmax(without(scores, suppress), axis=-1)


def _set_draft_adapter(model, active: bool):
    """Switch the checkpoint's draft adapter on or off; a no-op for a model without one."""
    switch = getattr(model, "set_draft_adapter", None)
    if switch is not None:
        switch(active)


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


class _Row:
    """A prompt's state in a batched run: its confirmed tokens (the prompt first), its max_tokens,
    the columns whose K/V are final, the drafts pending verification (and, sampled, their distributions), and
    its new tokens."""

    def __init__(self, index: int, prompt: List[int], budget: int, constraint):
        self.index, self.ids, self.budget, self.constraint = index, prompt, budget, constraint
        self.committed = 0
        self.drafts, self.q = [], None
        self.out: List[int] = []


class RoundPlan(NamedTuple):
    """A row's part of a round's forward: its tokens up to the forward's last column, where its
    forward starts, where its bidirectional window starts, its forward rows whose logits are read
    (counted from `start`) and its number of pending drafts."""

    ids: List[int]
    start: int
    split: int
    head: Tuple[int, int]
    k: int


class SelfSpeculativeDecoder(Decoder):
    """`mode="self_spec"`: lossless self-speculative decoding (the HF `linear_spec_generate`).

    Every forward has two parts. A causal part over the tokens whose K/V are not final yet (the
    last confirmed token, then the pending drafts) verifies the drafts: those the causal model
    agrees with are kept, plus its own next token, and the cache keeps the K/V of what was kept. A
    window of block_length masks after them, attending bidirectionally to everything before it and
    to itself, drafts the next round's tokens. Those drafts assume that every pending draft is kept;
    when one is rejected they are dropped, and the next forward verifies nothing and drafts afresh
    after the corrected token. The reference spends one draft forward and one verify forward per
    round; folding the next draft into the verify gives at least one token per forward (as AR
    decoding does) and the accepted drafts on top.

    The rows of a batch share each forward. Their accepted lengths differ every round, so each
    row's tokens and K/V sit in columns of its own (the backend's `row_forwards`: a row writes its
    forward's K/V after its own final ones, RoPE at its own columns, and the batch mask hides from
    it every column it has not written), and a row that finishes leaves the batch. At temperature
    0 a row's tokens are those it gets alone; above it, its draws depend on its batch-mates (the
    decoder's one key stream). The draft adapter's rounds batch the same way (`_run_rows_linear`).
    """

    # Structured output: each verified position's distribution masked by the grammar
    # (engine/constrained.TokenSequenceConstraint).
    takes_constraints = True
    # `run(cancelled=)` drops a cancelled row at its next round, and `run(budgets=)` restarts rows
    # over [prompt ; returned tokens] with what is left of their max_tokens (the server's joins).
    drops_cancelled_rows = True
    join_reencodes = True  # a restart runs the rows' prefill again
    judges_joins = True

    @classmethod
    def joins_exactly(cls, settings) -> bool:
        """Whether a restart over [prompt ; returned tokens] reproduces the run (engine.join_policy
        asks the decoder first): each row is AR decoding, whose next tokens depend on the tokens
        so far only, whatever forwards produced them and whichever rows share them; except that
        the thinking budget counts new tokens from the request's start, not the restart's."""
        return settings.end_think_token_id is None

    @classmethod
    def kv_kind(cls, settings):
        return None  # a run takes no cache.PriorKV (nor leaves one)

    def __init__(self, model, inputs: DecoderInputs, backend):
        self.model = model
        self.constraints = inputs.constraints  # one structured.Constraint (or None) per prompt
        self.spec = inputs.spec
        self.s = settings = inputs.settings
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        # The causal-prefix backend the registry picked for the `cache` setting brings the
        # batch's forwards, each row at columns of its own (a KV cache, or full recompute).
        self.row_forwards = backend.row_forwards
        self.key = mx.random.split(mx.random.key(settings.seed))[1]
        self.nfe = 0
        self.drafted = 0  # drafts verified
        self.accepted = 0  # drafts kept

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        constraints=None,
        consumed=None,
        budgets: Optional[Sequence[int]] = None,
        cancelled: AbstractSet[int] = frozenset(),
    ):
        """Decode `prompts`, a batch sharing each forward. `constraints`: each row's
        structured.Constraint (None: unconstrained; default: the decoder's), `consumed` the tokens
        each row already returned (its grammar continues after them), `budgets` each row's
        max_tokens (default: the setting's), `cancelled` a set the caller may grow while the run
        goes on (a row in it leaves at its next round), as MaskedBlockDecoder.run takes them."""
        adapter = getattr(self.model, "has_draft_adapter", False)
        linear = adapter or self.s.draft_threshold is not None
        constraints = self.constraints if constraints is None else constraints
        budgets = [self.s.max_tokens] * len(prompts) if budgets is None else budgets
        rows = []
        for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
            c = None if constraints is None else constraints[row]
            done = () if consumed is None else consumed[row]
            c = c and TokenSequenceConstraint(c, self.eos, budget, done)
            rows.append(_Row(row, [int(t) for t in prompt], budget, c))
        yield from (self._run_rows_linear if linear else self._run_rows)(rows, cancelled)

    def _end_thinking(self, new: List[int], out: List[int]) -> List[int]:
        """`new`, the round's tokens (new tokens number len(out).. of a row that has produced
        `out`), cut after the marker when ar_generate's thinking budget forces it among them."""
        marker, budget = self.s.end_think_token_id, self.s.max_thinking_tokens
        at = None if marker is None else budget - len(out)
        if at is None or not 0 <= at < len(new) or marker in out or marker in new[:at]:
            return new
        return new[:at] + [marker]

    def _logprobs(self, new: List[int], logits):
        """With the logprobs setting, the entries of a row's newly confirmed tokens; `logits`: the
        causal rows that gave them, in order (one more read)."""
        if self.s.logprobs is None:
            return None
        return entries(one_row_a_token(logits, len(new)), new, self.s.logprobs)

    def _confidence(self, news, logits) -> Optional[List[List[float]]]:
        """With `step_confidence`, each row's newly confirmed tokens' probabilities under the
        causal rows that gave them (one read for the batch)."""
        if not self.step_confidence:
            return None
        probs = []
        for new, lg in zip(news, logits):
            lg = one_row_a_token(lg, len(new)).astype(mx.float32)
            at = mx.take_along_axis(lg, mx.array(new, dtype=mx.int32)[:, None], axis=-1)[:, 0]
            probs.append(mx.exp(at - mx.logsumexp(lg, axis=-1)))
        mx.eval(probs)
        return [p.tolist() for p in probs]

    def _emit(self, rows: List[_Row], news, logits):
        """The block event of the rows' newly confirmed tokens `news`, which join their outputs;
        `logits[i]`: the causal rows that gave row i's, in order (their log-probabilities, with
        the logprobs setting: one more read)."""
        logprobs = [self._logprobs(new, lg) for new, lg in zip(news, logits)]
        confidence = self._confidence(news, logits)
        for r, new in zip(rows, news):
            r.out += new
        at_limit = [len(r.out) >= r.budget for r in rows]
        if self.s.logprobs is None:
            logprobs = None
        event = block_event([r.index for r in rows], news, at_limit, self.eos, self.nfe, logprobs)
        if confidence is not None:  # cut as the tokens are
            event.confidence = [c[: len(t)] for c, t in zip(confidence, event.tokens)]
        return event

    @staticmethod
    def _leave(rows: List[_Row], run, event, cancelled):
        """The rows that go on after `event`, and their forwards (finished and cancelled rows
        leave)."""
        keep = [
            i
            for i, done in enumerate(event.finished)
            if not done and rows[i].index not in cancelled
        ]
        if len(keep) == len(rows) or not keep:
            return [rows[i] for i in keep], run
        return [rows[i] for i in keep], run.select(keep)

    def _tokens(self, logits, suppress=()):
        return sample_tokens(logits, self.s, self.spec, next_key(self), suppress).tolist()

    def _plan(self, r: _Row) -> RoundPlan:
        """Row r's part of the next forward: its last confirmed token (whose K/V are not final),
        its pending drafts to verify, then the window of masks whose first column is the next
        round's confirmed token's and whose others draft the round after it."""
        left = r.budget - len(r.out)
        r.drafts = r.drafts[: left - 1]  # a round returns the kept drafts and one token more
        k = len(r.drafts)
        w = min(self.s.block_length, left - k - 1)
        w = w if w >= 2 else 0
        known = len(r.ids)
        ids = r.ids + r.drafts + [self.spec.mask_token_id] * w
        return RoundPlan(
            ids, r.committed, known + k, (known - 1 - r.committed, len(ids) - r.committed), k
        )

    def _greedy(self, rows, logits, plans):
        """At temperature 0, each unconstrained row's causal tokens at its verified rows and its
        window's drafts, read in one sync (None for a row that reads its own)."""
        if self.s.temperature != 0:
            return [None] * len(rows)
        lazy = [
            None
            if r.constraint is not None
            else (
                sample_tokens(lg[: p.k + 1], self.s, self.spec, None),
                self._greedy_drafts(self._window(lg, p.k)),
            )
            for r, lg, p in zip(rows, logits, plans)
        ]
        mx.eval([pair for pair in lazy if pair is not None])
        return [None if pair is None else (pair[0].tolist(), pair[1].tolist()) for pair in lazy]

    @staticmethod
    def _window(logits, k: int):
        """The forward rows that draft the next round: the window's after its first (whose
        column is the next confirmed token's)."""
        return logits[k + 2 :]

    def _greedy_drafts(self, window_logits):
        """At temperature 0, the drafts of the rows `window_logits` (lazy)."""
        if window_logits.shape[0] == 0:
            return mx.zeros((0,), dtype=mx.int32)
        return sample_tokens(window_logits, self.s, self.spec, None, (self.spec.mask_token_id,))

    def _sampled_drafts(self, window_logits):
        """Above temperature 0, the drafts of the rows `window_logits` and the distributions q
        they were drawn from."""
        mask_id = self.spec.mask_token_id
        drafts = self._tokens(window_logits, (mask_id,))
        return drafts, processed_probs(window_logits, self.s, self.spec, suppress=(mask_id,))

    def _run_rows(self, rows: List[_Row], cancelled):
        """The rows' rounds, one forward a round for all of them (see the class docstring)."""
        width = max(len(r.ids) + r.budget for r in rows)
        run = self.row_forwards(self.model, len(rows), width)
        while rows:
            plans = [self._plan(r) for r in rows]
            self.nfe += 1
            logits = run.mixed(*zip(*[(p.ids, p.start, p.split, p.head) for p in plans]))
            if self.nfe == 1:  # the run's first forward: corrupt weights show here (one sync)
                check_finite(mx.concatenate(logits), self.model)
            greedy = self._greedy(rows, logits, plans)
            news = [self._round(*args) for args in zip(rows, logits, plans, greedy)]
            event = self._emit(rows, news, [lg[: p.k + 1] for lg, p in zip(logits, plans)])
            yield event
            rows, run = self._leave(rows, run, event, cancelled)

    def _round(self, r: _Row, logits, plan: RoundPlan, greedy) -> List[int]:
        """Row r's confirmed tokens of a round from its forward rows `logits` (the k + 1 verified
        ones, the window's first, its drafts'); its next drafts and final columns are updated.
        `greedy`: its precomputed (causal tokens, window drafts) at temperature 0, or None."""
        k = plan.k
        verify, window_logits = logits[: k + 1], self._window(logits, k)
        new = self._accept(
            verify, r.drafts, r.q, r.constraint, None if greedy is None else greedy[0]
        )
        budgeted = self._end_thinking(new, r.out)
        # A forced marker replaces the causal model's token: the window's drafts followed that.
        kept_all = len(new) - 1 == k and budgeted == new
        new = budgeted
        n = len(new) - 1
        self.drafted += k
        self.accepted += n
        known = len(r.ids)
        r.ids = r.ids + new
        r.committed = known + n
        drafts, q = [], None
        if kept_all and window_logits.shape[0]:
            if greedy is not None:
                drafts = greedy[1]
            elif self.s.temperature == 0:  # a constrained row reads its own
                drafts = self._greedy_drafts(window_logits).tolist()
            else:
                drafts, q = self._sampled_drafts(window_logits)
        r.drafts, r.q = self._drafts(drafts, q, r.constraint)
        return new

    def _accept(self, verify, drafts, q, c, ar=None):
        """The kept drafts and the causal model's own next token (greedy match, or speculative
        sampling above temperature 0); under c, a row's TokenSequenceConstraint, over the
        grammar's masked distributions, the round's tokens then kept within the budget. `ar`:
        the causal tokens at the verified rows, when already read (temperature 0)."""
        if c is None:
            return self._verified(verify, drafts, q, ar)
        allowed, j = c.masks(drafts, verify.shape[-1])
        verify = mask_logits(verify[: j + 1], allowed)
        return c.keep(self._verified(verify, drafts[:j], None if q is None else q[:j]))

    def _drafts(self, drafts, q, c, limit=None):
        """The next round's drafts with the grammar's (c's) forced tokens first (always kept), at
        most `limit` of them."""
        forced = [] if c is None else c.forced()[:limit]
        if not forced:
            return drafts, q
        n = len(forced)
        if q is not None or (self.s.temperature != 0 and not drafts):
            width = self.model.args.vocab_size if q is None else q.shape[-1]
            one_hot = (mx.arange(width)[None] == mx.array(forced)[:, None]).astype(mx.float32)
            q = one_hot if q is None else mx.concatenate([one_hot, q[n:]])[: max(n, len(drafts))]
        return forced + drafts[n:], q

    def _verified(self, verify, drafts, q, ar=None):
        if self.s.temperature == 0:
            ar = self._tokens(verify) if ar is None else ar
            n = next((i for i in range(len(drafts)) if ar[i] != drafts[i]), len(drafts))
            return drafts[:n] + [ar[n]]
        return speculative_accept(
            processed_probs(verify, self.s, self.spec), q, drafts, next_key(self)
        )

    def _draft(self, run, rows: List[_Row]):
        """Each row's block drafts (the columns after its last confirmed token's, block_length - 1
        of them) and, above temperature 0, the distributions they were drawn from (else None).
        One forward fills every mask; with `draft_threshold`, forwards repeat until every row's
        masks are filled, each revealing a row's masks whose confidence (the softmax probability
        of the proposal) reaches it, at least its most confident one (linear_spec_generate's
        threshold > 0); a row already filled is left as it is."""
        s, spec, model = self.s, self.spec, self.model
        mask_id, threshold = spec.mask_token_id, s.draft_threshold
        width, b = s.block_length - 1, len(rows)
        starts = [len(r.ids) - 1 for r in rows]
        drafts = mx.full((b, width), mask_id, dtype=mx.int32)
        masked = mx.ones((b, width), dtype=mx.bool_)
        q = None
        while True:
            ids = [r.ids + d for r, d in zip(rows, drafts.tolist())]
            _set_draft_adapter(model, True)
            try:
                self.nfe += 1
                logits = mx.stack(run.mixed(ids, starts, starts, [(1, width + 1)] * b))
            finally:
                _set_draft_adapter(model, False)
            tokens = mx.array(self._tokens(logits, suppress=(mask_id,)), dtype=mx.int32)
            reveal = masked
            if threshold is not None:
                p = mx.softmax(logits.astype(mx.float32), axis=-1)
                confidence = mx.take_along_axis(p, tokens[..., None], axis=-1)[..., 0]
                reveal = threshold_commit(confidence, masked, threshold) & masked
            if s.temperature != 0:
                probs = processed_probs(logits, s, spec, suppress=(mask_id,))
                q = probs if q is None else mx.where(reveal[..., None], probs, q)
            drafts = mx.where(reveal, tokens, drafts)
            masked = masked & ~reveal
            if not masked.any().item():
                return drafts.tolist(), [None] * b if q is None else list(q)

    def _verify_linear(self, rows: List[_Row], run):
        """A round after the first: the rows' blocks drafted, then verified by one causal
        forward over them with the adapter off; each row's kept drafts and the causal next token
        (and the verify forward's rows, for their log-probabilities). The K/V of each row's last
        confirmed token and of its kept drafts are final; the next token's are not."""
        drafts, qs = self._draft(run, rows)
        for i, r in enumerate(rows):
            if r.constraint is not None:
                drafts[i], qs[i] = self._drafts(drafts[i], qs[i], r.constraint, len(drafts[i]))
        ids = [r.ids + d for r, d in zip(rows, drafts)]
        starts = [len(r.ids) - 1 for r in rows]
        self.nfe += 1
        window = self.s.block_length
        logits = run.mixed(ids, starts, [len(x) for x in ids], [(0, window)] * len(rows))
        news = []
        for r, verify, d, q in zip(rows, logits, drafts, qs):
            new = self._end_thinking(self._accept(verify, d, q, r.constraint), r.out)
            self.drafted += len(d)
            self.accepted += len(new) - 1
            r.ids = r.ids + new
            news.append(new[: r.budget - len(r.out)])
        return news, logits

    def _run_rows_linear(self, rows: List[_Row], cancelled):
        """Rounds of the reference's `linear_spec_generate` (used with the draft adapter, or with
        `draft_threshold`), the rows sharing each forward: a row's block [t, masks] (t its last
        confirmed token, whose K/V are not computed yet) is drafted with the adapter on, attending
        to the final K/V before it and to itself; a causal forward over the block with the
        adapter off verifies the drafts; the kept ones and the causal next token are returned.
        The first round is the prompts' causal prefill and its next token."""
        model, window = self.model, self.s.block_length
        width = max(len(r.ids) + r.budget for r in rows) + window
        run = self.row_forwards(model, len(rows), width)
        _set_draft_adapter(model, False)
        self.nfe += 1
        ends = [len(r.ids) for r in rows]
        logits = run.mixed([r.ids for r in rows], [0] * len(rows), ends, [(e - 1, e) for e in ends])
        check_finite(mx.concatenate(logits), model)
        news = [self._end_thinking(self._tokens(lg), r.out) for r, lg in zip(rows, logits)]
        for r, new in zip(rows, news):
            r.ids = r.ids + new
        while rows:
            event = self._emit(rows, news, logits)
            yield event
            rows, run = self._leave(rows, run, event, cancelled)
            if rows:
                news, logits = self._verify_linear(rows, run)


def one_row_a_token(logits, count: int):
    """`logits`' first `count` rows; closing tokens the budget guard placed past the verified
    rows (structured output) had no forward of their own: the last verified row's distribution."""
    if count > logits.shape[0]:
        extra = mx.repeat(logits[-1:], count - logits.shape[0], axis=0)
        logits = mx.concatenate([logits, extra])
    return logits[:count]
