"""I-DLM's Introspective Strided Decoding (thuEcstasy/I-DLM @ 3342a17,
inference/sglang/sglang/srt/dllm/algorithm/idlm_blockN.py, `IDLMBlockN.run`): one causal forward
verifies the previous round's drafts and drafts the next ones.

With N the `block_length` setting (the reference's gen_block_size), the reference's rounds are:

* prefill: the prompt alone; its last row gives the first token t0 (it returns nothing yet).
* cold start: [t, M x (N - 1)] (padded to 2N - 1 with masks no row before them reads, the attention
  being causal): t's row gives the clean token, the mask rows' argmaxes N - 1 drafts.
* verify: [pending, d_0 .. d_(k-1), M x (N - 1)]: draft d_i is kept while it equals the argmax of
  the row before it (above temperature 0, by p/q speculative acceptance); with every draft kept the
  last draft's row gives the clean token and the mask rows the next drafts; at the first rejection
  the row's token (the correction) replaces it, and the next round is a cold start from it.

The K/V of the pending token and of the kept drafts stay in the cache, the rest is dropped, which
is self-speculation's cache rule (engine/self_spec.py), whose batched rows (each at columns of its
own), constraints, logprobs and cancellation this decoder inherits; what differs is the forward
(causal throughout, no bidirectional window), where the drafts are read (every mask row, argmax)
and the prompt's forward, which drafts nothing. At temperature 0 the tokens are the causal model's
greedy AR tokens; the forwards are the reference's: one for the prompt, one per round.
"""

from ..decoding.idlm import draft_distributions, draft_tokens, target_distributions
from .base import next_key
from .self_spec import RoundPlan, SelfSpeculativeDecoder, processed_probs, speculative_accept


class IDLMDecoder(SelfSpeculativeDecoder):
    """I-DLM's strided decoding (see the module docstring); `block_length` is N, the most tokens a
    forward returns. The family's model file names it and its `sampler` value."""

    def _plan(self, r) -> RoundPlan:
        """Row r's part of the next forward: the prompt alone first (the reference's prefill),
        then its pending token, its drafts and N - 1 masks, causal throughout."""
        left = r.budget - len(r.out)
        # A round returns the kept drafts and one token more: drafts past the budget are never
        # returned, and masks past it draft nothing that is read.
        r.drafts = r.drafts[: left - 1]
        k = len(r.drafts)
        masks = 0 if not r.out else max(0, min(self.s.block_length - 1, left - k - 1))
        known = len(r.ids)
        ids = r.ids + r.drafts + [self.spec.mask_token_id] * masks
        head = (known - 1 - r.committed, len(ids) - r.committed)
        return RoundPlan(ids, r.committed, len(ids), head, k)

    @staticmethod
    def _window(logits, k: int):
        # Every mask row drafts: the first predicts the token after the round's clean one.
        return logits[k + 1 :]

    def _greedy_drafts(self, window_logits):
        return draft_tokens(window_logits)

    def _sampled_drafts(self, window_logits):
        drafts = draft_tokens(window_logits).tolist()
        return drafts, draft_distributions(window_logits, self.s.temperature)

    def _verified(self, verify, drafts, q, ar=None):
        if self.s.temperature == 0:
            return super()._verified(verify, drafts, q, ar)
        clean = processed_probs(verify[-1:], self.s, self.spec)
        p = target_distributions(verify, self.s.temperature, clean)
        return speculative_accept(p, q, drafts, next_key(self))
