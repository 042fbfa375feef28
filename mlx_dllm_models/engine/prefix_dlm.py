"""LaViDa's prefix-DLM decoding (jacklishufan/LaViDa, `llada/generate.py` with prefix_lm=True): the
prompt (image features + text) attends to itself only and the answer to everything, so the
prompt's K/V are computed once and are exact for the whole run.

This is causal_prefix.py's `causal_context=False` layout with one difference: the answer is one
segment however many blocks it has. The reference runs every denoising forward over the whole
answer (the masks of later blocks included) against the prompt's cached K/V, and only the block's
confidences compete for the commit; no finished block is ever encoded into the cache. So the
backend here is the causal-prefix one (the prompt encoded bidirectionally by `prefill`, the cache
written in place and never extended past the prompt) whose denoising forward spans the answer,
with the logits of the block's columns read from it; the same forward over the whole sequence
under masks.prompt_block_mask (the answer as one segment) gives the same logits (a test holds it
to that). `cache="none"` is the reference's other mode, prefix_lm=False (the README's "KV cache
off"): full recompute with every position attending everywhere, LLaDA's and Dream's own generate,
a different attention (the README reports other scores for it), not a recompute of this one.

LaViDa-Dream (Dream's logit shift: column c is predicted from hidden state c - 1) adds two things,
both from its `_sample` with prefix_lm=True: the prefill's last logit seeds the answer's first
column (its argmax, whatever the temperature), and the first column's logits in a denoising
forward are its own hidden state's (`cat([logits[:, :1], logits[:, :-1]])`; that column is the
seed, never a candidate).

A run leaves no K/V for a later prompt (the prompt's K/V depend on all of it), and a row cannot
join a running batch by a restart: the restart would move the committed tokens into the prompt,
which attends to no answer column.
"""

from dataclasses import replace

import mlx.core as mx

from ..decoding.logprobs import log_probs
from .causal_prefix import CausalPrefixCache


class PrefixDLMCache(CausalPrefixCache):
    """Backend of the masked block engine (see full_recompute.py for the interface)."""

    @classmethod
    def joins_exactly(cls, settings) -> bool:
        return False  # see the module docstring

    @classmethod
    def kv_kind(cls, settings):
        return None

    def __init__(self, model, spec, layout, settings):
        # causal_context=False: the prompt is encoded bidirectionally and seeds no block.
        super().__init__(model, spec, layout, replace(settings, causal_context=False))
        self.width = layout.width
        # The answer (and an infilling suffix) is one segment after the prompt.
        self.fwd = self.forwards(model, layout.width, self.pads, (self.prompt_end, layout.width))

    def prefill(self, x):
        p, shift = self.prompt_end, self.spec.logit_shift
        if not shift:
            return super().prefill(x)
        self.nfe += 1
        logits = self.fwd.mixed(x, 0, 0, p, head_span=(p - 1, p))
        self.fwd.keep(p)
        self.seed = mx.argmax(logits[:, -1], axis=-1)
        if self.settings.logprobs is not None:  # the seeded column's, for masked.py
            self.seed_log_probs = log_probs(logits[:, -1])

    def begin_block(self, x, start, stop):
        if self.seed is not None and start == self.prompt_end:
            x[:, start] = mx.where(self.generated[:, start], self.seed, x[:, start])
        return x

    def block_logits(self, x, start, stop):
        self.nfe += 1
        p, shift = self.prompt_end, self.spec.logit_shift
        first = max(start - shift, p)
        logits = self.fwd.mixed(x, p, p, self.width, head_span=(first - p, stop - shift - p))
        if start - shift < p:  # the answer's first column reads its own hidden state
            logits = mx.concatenate([logits[:, :1], logits], axis=1)
        return logits

    def end_block(self, x, start, stop):
        pass  # no block's K/V are final: the answer is recomputed at every step
