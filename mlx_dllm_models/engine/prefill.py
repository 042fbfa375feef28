"""Dimple's prefilling (`cache="prefill"`, yu-rp/Dimple generation_utils.py `_sample` with
use_cache=True): an approximate prompt cache for the bidirectional families, opt-in except where a
family's recipe names it (Dimple's README).

The reference's first step runs the whole sequence (prompt and all-mask canvas) and keeps the K/V
of the prompt's columns but its last (`crop(prompt_length)`, prompt_length = prompt - 1); every
later step runs the columns from the prompt's last one to the end against those K/V, which are
never recomputed (computed when the canvas was all masks: an approximation, as Fast-dLLM's prefix
cache). Starting one column before the canvas gives its first position the logits of its left
neighbour (Dream's shift), so nothing is committed ahead of the step's rule, unlike Fast-dLLM's
Dream path (engine/fast_dllm.py), which commits the block's first column from the full forward.

The K/V live in fast_dllm's window buffer (cache.ApproximateKVCache); padding, positions and row
selection are fast_dllm's. Each block starts with a full forward, as the reference's one block
(the whole canvas) does.
"""

from .fast_dllm import FastDLLMCache


class PrefillCache(FastDLLMCache):
    """Backend of the masked block engine (see full_recompute.py for the interface)."""

    name = "prefill"
    # Every draw is the step rule's (nothing is committed at the block's start).
    draws_batch_wide = False

    @classmethod
    def check_settings(cls, spec, settings):
        """Every sampler of the family decodes under it: the reference runs its pipelines
        ("dim" and "dream") with this cache."""

    def begin_block(self, x, start, stop):
        self.block = (start, stop)
        self.since_full = None
        return x

    def cached_window(self, lo: int, stop: int):
        start, _ = self.block
        # From the column before the first candidate (the prompt's last column): its hidden state
        # gives the first candidate's logits.
        return max(min(lo, start) - self.shift, 0), self.width
