"""WeDLM's streaming parallel decoding (github.com/Tencent/WeDLM, wedlm/engine/wedlm_decoder.py and
sampler.py): diffusion decoding on an ordinary causal K/V cache.

A row keeps a window of `block_length` positions (the reference's wedlm_window_size) after its
committed tokens, masks at first. Every step is one forward over the window:

1. the window's committed prefix (its filled positions before the first mask, filled by earlier
   steps) is given as many new masks at the window's end (`_refill_window_masks`);
2. the forward runs with the filled positions ordered before the masks under causal attention
   (topological reordering): every mask sees every filled token, and the committed prefix sees only
   what precedes it, so its K/V are exactly the causal model's and are kept;
3. that prefix leaves the window and is returned (EOS ends the row, as max_tokens does);
4. among the window's masks, those whose entropy plus the position penalty is below
   `entropy_threshold` are filled with their proposals, at least the least of them
   (decoding.wedlm.wedlm_commit). Filled positions are never re-masked.

The reference writes the reordered window into its paged cache; here the window stays in column
order and the forward gets the keep mask that the reordered causal attention implies
(decoding.wedlm.reordered_causal_mask), with RoPE on the columns as the reference's position ids:
the same attention, on mlx-lm's cache protocol. The reference's separate prefill forward is folded
into the first step (the prompt's rows are causal either way). Rows of a batch run one after
another: their windows commit different lengths every step, so their caches would not stay aligned.
"""

from typing import List, Sequence

import mlx.core as mx

from ..cache import PrefixKVCache
from ..decoding import token_stats
from ..decoding.wedlm import committed_prefix, reordered_causal_mask, wedlm_commit
from .base import StepEvent, block_event, check_finite, next_key
from .logprobs import entries


class WindowKV:
    """`cache="prefix"` (the default): the K/V of committed columns are kept (cache.PrefixKVCache,
    written in place), and each forward runs over the columns after them only."""

    def __init__(self, model, width: int):
        self.model = model
        self.cache = PrefixKVCache(len(model.layers), width)

    def logits(self, ids: Sequence[int], filled: Sequence[bool], start: int) -> mx.array:
        """(n - start, V) logits of columns start..n-1 of the row `ids` (n columns, `filled`
        saying which hold tokens: committed and filled ones), under the reordered causal mask."""
        lo = self.cache.committed
        keep = reordered_causal_mask(filled, lo)
        x = mx.array([list(ids[lo:])], dtype=mx.int32)
        return self.model(
            x, cache=self.cache.at(lo), mask=keep, head_span=(start - lo, len(ids) - lo)
        )[0]

    def commit(self, column: int):
        """Columns before `column` hold final K/V."""
        self.cache.commit(column)


class WindowRecompute:
    """`cache="none"`: every forward runs over the whole row (no K/V kept); the same mask."""

    def __init__(self, model, width: int):
        self.model = model

    def logits(self, ids, filled, start):
        x = mx.array([list(ids)], dtype=mx.int32)
        keep = reordered_causal_mask(filled)
        return self.model(x, mask=keep, head_span=(start, len(ids)))[0]

    def commit(self, column: int):
        pass


class _Window:
    """A row's window: its tokens, which are filled, and (with the logprobs setting) each filled
    position's TokenLogprob."""

    def __init__(self, mask_id: int, size: int):
        self.mask_id = mask_id
        self.tokens: List[int] = [mask_id] * size
        self.filled: List[bool] = [False] * size
        self.logprobs: List = [None] * size

    def refill(self):
        """As many new masks at the end as the committed prefix holds (`_refill_window_masks`)."""
        n = committed_prefix(self.filled)
        self.tokens += [self.mask_id] * n
        self.filled += [False] * n
        self.logprobs += [None] * n

    def prune(self):
        """The committed prefix, removed from the window: (tokens, logprobs)."""
        n = committed_prefix(self.filled)
        out = self.tokens[:n], self.logprobs[:n]
        del self.tokens[:n], self.filled[:n], self.logprobs[:n]
        return out


class WeDLMDecoder:
    """The `wedlm` decoder: one prompt at a time, a step per forward (see the module docstring)."""

    # The `sampler` setting's names this loop has a rule for (tests/test_sampler_rules.py).
    samplers = ("wedlm",)
    constraint_alternative = "WeDLM's window decoding does not take structured-output constraints"

    def __init__(self, model, settings: dict, eos_token_ids: Sequence[int], backend=None):
        self.model = model
        self.spec = model.diffusion_spec
        self.s = settings
        self.eos = set(int(e) for e in eos_token_ids)
        self.backend = backend
        self.key = mx.random.split(mx.random.key(settings["seed"]))[1]
        self.nfe = 0

    def run(self, prompts: Sequence[Sequence[int]]):
        for row, prompt in enumerate(prompts):
            yield from self._run_row(row, [int(t) for t in prompt])

    def _fill(self, logits: mx.array, window: _Window):
        """Step 4: fill the masks the rule picks, from the mask rows of this step's logits."""
        s = self.s
        greedy = s["temperature"] == 0
        # Over every window row: the position penalty counts window columns, filled ones too. The
        # mask id is not suppressed, as in the reference's sampler: the window's flags, not its
        # token values, say what is filled.
        stats = token_stats(
            logits[None],
            temperature=s["temperature"],
            top_k=None if greedy else s["top_k"],
            top_p=None if greedy else s["top_p"],
            key=None if greedy else next_key(self),
            order=self.spec.sampling_order,
        )
        masked = mx.array([[not f for f in window.filled]])
        pick = wedlm_commit(stats.entropy, masked, s["entropy_threshold"], s["pos_penalty_factor"])
        chosen = [k for k, p in enumerate(pick[0].tolist()) if p]
        proposals = stats.x0[0].tolist()
        lps = None
        if s.get("logprobs") is not None:
            lps = entries(logits[mx.array(chosen)], [proposals[k] for k in chosen], s["logprobs"])
        for n, k in enumerate(chosen):
            window.tokens[k] = proposals[k]
            window.filled[k] = True
            window.logprobs[k] = None if lps is None else lps[n]

    def _step_event(self, row: int, out: List[int], window: _Window) -> StepEvent:
        limit, mask_id = self.s["max_tokens"], self.spec.mask_token_id
        canvas = (out + window.tokens)[:limit]
        canvas += [mask_id] * (limit - len(canvas))
        block = (len(out), min(limit, len(out) + len(window.tokens)))
        return StepEvent([row], mx.array([canvas], dtype=mx.int32), block, self.nfe)

    def _run_row(self, row: int, prompt: List[int]):
        s = self.s
        size, limit = s["block_length"], s["max_tokens"]
        # The window reaches at most 2 * size columns past the committed ones (size, then as many
        # refilled masks as the prefix it commits).
        run = self.backend(self.model, len(prompt) + limit + 2 * size)
        window = _Window(self.spec.mask_token_id, size)
        context = list(prompt)  # the committed columns (prompt, then returned tokens)
        out: List[int] = []
        while True:
            window.refill()
            start = len(context)
            logits = run.logits(context + window.tokens, [True] * start + window.filled, start)
            self.nfe += 1
            if self.nfe == 1:  # the run's first forward: corrupt weights show here (one sync)
                check_finite(logits, self.model)
            tokens, lps = window.prune()
            run.commit(start + len(tokens))
            context += tokens
            if tokens:
                event = self._commit(row, tokens, lps, out)
                yield event
                if event.finished[0]:
                    return
            self._fill(logits[len(tokens) :], window)
            yield self._step_event(row, out, window)

    def _commit(self, row: int, tokens: List[int], lps, out: List[int]):
        """The block event of a row's newly committed tokens, cut at max_tokens (the reference's
        scheduler stops appending there) and at the first EOS (kept, then cut by block_event)."""
        tokens = tokens[: self.s["max_tokens"] - len(out)]
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        tokens = tokens[:cut]
        out += tokens
        logprobs = None if self.s.get("logprobs") is None else [list(lps[: len(tokens)])]
        finished = len(out) >= self.s["max_tokens"]
        return block_event([row], [tokens], [finished], self.eos, self.nfe, logprobs)
