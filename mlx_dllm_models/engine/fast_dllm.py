"""Fast-dLLM's approximate KV caches for the bidirectional families (LLaDA, LLaDA-MoE, Dream):
`cache="prefix"` and `cache="dual"`, opt-in; `cache="none"` (full recompute) stays the default.

In a bidirectional model every position attends to every other, so no K/V is ever final: a cache
is an approximation, traded for speed (Fast-dLLM, Wu et al. 2025). Both caches reproduce NVlabs/
Fast-dLLM `llada/generate.py` (`generate_with_prefix_cache`, `generate_with_dual_cache`) and, for
Dream, `dream/model/generation_utils_block.py` (`_sample` with and without `dual_cache`):

* At a block's first step a full forward over the whole sequence fills the K/V of every column;
  its logits drive that step.
* prefix: the block's later steps run the block and everything after it (the masks of later
  blocks, an infilling suffix) against the K/V the full forward left for the columns before it.
* dual: the later steps run the block's columns only, writing their K/V in place and attending to
  the prefix and the suffix as the full forward left them (the suffix is stale: computed when the
  block was all masks).

Dream predicts column c from hidden state c - 1, which a forward starting at the block's first
column lacks. Fast-dLLM's Dream variant commits the block's first column from the full forward
(where its left neighbour is present), unconditionally, and lets the block's first row take its
own logits in the cached forwards: that column is never a candidate there. `begin_block` does it.

The K/V live in one preallocated buffer per layer (cache.ApproximateKVCache): each forward writes
its columns in place and reads the whole window; nothing is copied or concatenated per step.
Batches with left padding read a padding mask and per-row positions, as FullRecompute does;
classifier-free guidance (LLaDA) runs its unconditional rows in the same forwards, with their own
K/V rows. The candidate window may start before the block (masks inside a prompt, infilling): the
cached forwards then start at the window (one column earlier for Dream), so that every candidate
gets logits from its own left neighbour.

`refresh` (a class attribute, None by default) runs a full forward every `refresh` steps of a
block; at 1 every step is a full forward and decoding equals full recompute token for token (a
test holds it to that).
"""

from typing import List, Optional, Tuple

import mlx.core as mx

from ..cache import ApproximateKVCache
from ..decoding.llada import guided_logits, unconditional_tokens
from ..masks import padding_mask
from ..settings import SettingsError
from ..spec import SHARED_SAMPLERS
from .base import next_key, replaced, sample_tokens
from .contracts import Backend


class FastDLLMCache(Backend):
    """Backend of the masked block engine (see full_recompute.py for the interface). The
    subclasses below set `dual`."""

    dual = False
    name = "prefix"
    guidance = True  # classifier-free guidance's unconditional rows ride in the same forwards
    # A full forward every `refresh` steps of a block (None: at the block's first step only).
    refresh: Optional[int] = None
    # Dream's first block column is drawn from one key for the batch (sample_tokens): rows of
    # different seeds cannot share a run.
    draws_batch_wide = True

    @classmethod
    def check_settings(cls, spec, settings):
        """Settings the approximate caches cannot honour, refused before decoding starts."""
        if settings.sampler not in SHARED_SAMPLERS:
            raise SettingsError(
                f"cache={cls.name!r} follows Fast-dLLM's block-wise decoding and works with the "
                f"shared samplers ({', '.join(SHARED_SAMPLERS)}); sampler "
                f"{settings.sampler!r} decodes with its own schedule: use cache='none' with it, "
                "or a shared sampler"
            )

    def __init__(self, model, spec, layout, settings):
        if layout.aligned:
            raise ValueError(
                f"cache={self.name!r} is Fast-dLLM's cache of bidirectional families; "
                "block-causal families have an exact prefix cache"
            )
        self.check_settings(spec, settings)
        self.model, self.spec, self.settings = model, spec, settings
        self.shift = spec.logit_shift
        self.width = layout.width
        self.cfg_scale = settings.cfg_scale or 0.0
        self.key = mx.random.split(mx.random.key(settings.seed))[1]
        self.nfe = 0
        self.full_forwards = 0  # forwards over the whole sequence (one per block unless refresh)
        vars(self).update(self._row_state(layout))
        self.block = None  # (start, stop) of the open block
        self.since_full = None  # cached forwards since the last full one (None: none yet)

    def _row_state(self, layout) -> dict:
        """The attributes that depend on the batch's rows: padding, mask, the unconditional rows,
        the cache."""
        pads = list(layout.pads)
        ends = layout.ends if len(set(layout.ends)) > 1 else None
        state = {}
        if self.cfg_scale:
            # Classifier-free guidance: the unconditional rows follow the conditional ones.
            pads, ends = pads * 2, None if ends is None else list(ends) * 2
            state["given"] = layout.given
        state["mask"] = padding_mask(pads, self.width, ends=ends)
        state["pads"] = pads if any(pads) else None
        state["generated"] = layout.generated
        state["cache"] = ApproximateKVCache(len(self.model.layers), self.width, state["pads"])
        return state

    def _forward(self, x, w0, w1, lo, hi):
        """Logits (B, hi - lo, V) of columns lo..hi-1 from a forward over columns w0..w1-1 that
        writes their K/V in place and reads every column's. Column c reads hidden state
        c - shift; one before w0 reads w0's own (Fast-dLLM's Dream block forwards)."""
        self.nfe += 1
        h_lo = min(max(lo - self.shift, w0), w1 - 1)
        h_hi = max(hi - self.shift, h_lo + 1)
        tokens = x[:, w0:w1]
        if self.cfg_scale:
            un = unconditional_tokens(x, self.given, self.spec.mask_token_id)[:, w0:w1]
            tokens = mx.concatenate([tokens, un])
        mask = None if self.mask is None else self.mask[:, :, w0:w1]
        logits = self.model(
            tokens, cache=self.cache.at(w0), mask=mask, head_span=(h_lo - w0, h_hi - w0)
        )
        if self.cfg_scale:
            n = x.shape[0]
            logits = guided_logits(logits[:n], logits[n:], self.cfg_scale)
        rows = mx.arange(lo, hi) - self.shift
        if lo - self.shift < h_lo or h_hi > hi - self.shift:
            logits = logits[:, mx.clip(rows, h_lo, h_hi - 1) - h_lo]
        return logits

    def _full(self, x, lo, hi):
        self.full_forwards += 1
        self.since_full = 0
        logits = self._forward(x, 0, self.width, lo, hi)
        self.cache.commit(self.width)  # every column now has K/V
        return logits

    def prefill(self, x):
        pass

    def begin_block(self, x, start, stop):
        self.block = (start, stop)
        self.since_full = None
        if self.shift and self.refresh != 1:
            # Fast-dLLM's Dream: the full forward commits the block's first column, whose left
            # neighbour the block's cached forwards do not run.
            logits = self._full(x, start, start + 1)[:, 0]
            suppress = (self.spec.mask_token_id, *self.spec.suppressed_token_ids)
            token = sample_tokens(logits, self.settings, self.spec, next_key(self), suppress)
            masked = (x[:, start] == self.spec.mask_token_id) & self.generated[:, start]
            x[:, start] = mx.where(masked, token, x[:, start])
        return x

    def block_logits(self, x, lo, stop):
        if self.since_full is None or (self.refresh and self.since_full + 1 >= self.refresh):
            return self._full(x, lo, stop)
        self.since_full += 1
        w0, w1 = self.cached_window(lo, stop)
        return self._forward(x, w0, w1, lo, stop)

    def cached_window(self, lo: int, stop: int) -> Tuple[int, int]:
        """The columns (w0, w1) a forward between two full ones runs, for the candidates lo..stop-1
        of the current block."""
        start, _ = self.block
        # Candidates before the block (infilling) are recomputed with it, from their own left
        # neighbour; Dream's block start reads its own row (its column is committed).
        w0 = start if lo >= start else max(lo - self.shift, 0)
        return w0, stop if self.dual else self.width

    def end_block(self, x, start, stop):
        self.block = None

    def select(self, layout, idx: List[int]):
        # Rows may leave mid-block (a cancelled one), where the block's cached forwards read the
        # K/V its first forward left: the survivors keep their rows of the cache (the
        # unconditional rows of guidance too, which follow the conditional ones).
        state = self._row_state(layout)
        rows = list(idx)
        if self.cfg_scale:
            rows += [i + self.generated.shape[0] for i in idx]
        state["cache"] = self.cache.select(rows, state["pads"])
        return replaced(self, **state)


class ApproxPrefixCache(FastDLLMCache):
    """cache="prefix": Fast-dLLM's `generate_with_prefix_cache`."""


class DualCache(FastDLLMCache):
    """cache="dual": Fast-dLLM's `generate_with_dual_cache`."""

    dual = True
    name = "dual"
