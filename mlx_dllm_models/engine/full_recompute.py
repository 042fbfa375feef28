"""Full recompute: the masked block engine's reference backend, and the default of bidirectional
families (`cache="none"`, which engine.registry maps to it). Every denoising forward runs over the
whole sequence, so nothing computed at one step is kept for the next.

A backend of the masked block engine (this one, block_cache, causal_prefix, fast_dllm) is built as
`Backend(model, spec, layout, settings)` and has `prefill(x)`; `begin_block(x, start, stop)`, which
returns the tokens with anything it decides (a seed) placed; `block_logits(x, lo, stop)`, the
(B, stop - lo, V) logits of the candidate window; `end_block(x, start, stop)`; `select(layout,
rows)`, the backend of the surviving rows (between blocks, and between two steps of a block when a
row is cancelled: the survivors keep their state and K/V as they were); and `nfe`, its forward
count (contracts.BlockBackend). It subclasses contracts.Backend, whose attributes are the
capabilities it declares (guidance, row_steps, joins_exactly, ...), with their defaults.
"""

from typing import List

import mlx.core as mx

from ..cache import Positions
from ..decoding.llada import guided_logits, unconditional_tokens
from ..masks import block_causal_mask, every_key, padding_mask
from ..settings_fields import ResolvedSettings
from ..spec import BLOCK_CAUSAL
from .block_cache import seed_block_start, seeds_at
from .contracts import Backend, ExactRestarts
from .layout import Layout


class FullRecompute(ExactRestarts, Backend):
    """Every step runs the model over the whole sequence (prompt + canvas). The exact mode for
    bidirectional models, whose every position attends to every other, and the reference mode of
    block-causal ones (under their block-causal mask). Left-padded rows get a padding mask and
    per-row positions; the LM head only runs over the block's rows."""

    # It runs LLaDA's classifier-free guidance (cfg_scale): unconditional rows in the same forward.
    guidance = True
    # Its `select(layout, rows)` is a view the engine may run a step's forward on when only those
    # rows have masks left in the block (every forward recomputes from the tokens: nothing to keep).
    row_steps = True
    # A row may join a running batch by a restart over [prompt ; committed] (the server's joins):
    # every forward recomputes from the tokens, so the restart sees what the run would have, and
    # re-encodes nothing it had kept.
    join_reencodes = False

    def __init__(self, model, spec, layout: Layout, settings: ResolvedSettings):
        self.model = model
        self.shift = spec.logit_shift
        self.nfe = 0
        width = layout.width
        ends = None
        if spec.attention == BLOCK_CAUSAL:
            self.mask = block_causal_mask(
                width,
                settings.block_length,
                left_padding=layout.pads if any(layout.pads) else None,
                on_columns=layout.prompt_end,
                ends=layout.right_ends,
            )
        else:
            # Rows with different budgets (server.py): a row never attends past its own last
            # column, as alone it has no column there (the width is the longest row's, and
            # stays so after that row leaves).
            # An infilling suffix follows each row's canvas and is attended.
            ends = [e + layout.suffix_length for e in layout.ends]
            ends = ends if min(ends) < width else None
            self.mask = padding_mask(layout.pads, width, ends=ends)
        self.cache = Positions.for_left_padding(layout.pads, len(model.layers))
        self.spec, self.settings = spec, settings
        self.decoded = layout.decoded
        self.seed_log_probs = None
        self.cfg_scale = settings.cfg_scale or 0.0
        if self.cfg_scale:
            # Classifier-free guidance (LLaDA): the unconditional rows follow the conditional ones
            # in the same forward, with the same padding.
            pads = list(layout.pads) * 2
            self.mask = padding_mask(pads, width, ends=None if ends is None else ends * 2)
            self.cache = Positions.for_left_padding(pads, len(model.layers))
            self.given = layout.given
        if self.mask is None and self.cache is None:
            # Every key, given explicitly: a call with neither mask nor cache is the model's plain
            # forward, which is causal for some bidirectionally decoded families (Open-dCoder).
            self.mask = every_key(width)

    def prefill(self, x):
        pass

    def begin_block(self, x, start, stop):
        if not seeds_at(self.spec, self.settings.block_length, start):
            return x
        # The block's seed (spec.seeds_block_start): under the block-causal mask the logit before
        # the block sees the finished blocks only, whatever the masks after it hold.
        self.nfe += 1
        logits = self.model(x, cache=self.cache, mask=self.mask, head_span=(start - 1, start))
        return seed_block_start(self, x, logits[:, -1], start)

    def block_logits(self, x, start, stop):
        self.nfe += 1
        span = (start - self.shift, stop - self.shift)
        if self.cfg_scale:
            un = unconditional_tokens(x, self.given, self.spec.mask_token_id)
            both = self.model(
                mx.concatenate([x, un]), cache=self.cache, mask=self.mask, head_span=span
            )
            n = x.shape[0]
            return guided_logits(both[:n], both[n:], self.cfg_scale)
        return self.model(x, cache=self.cache, mask=self.mask, head_span=span)

    def end_block(self, x, start, stop):
        pass

    def select(self, layout: Layout, idx: List[int]) -> "FullRecompute":
        fresh = type(self)(self.model, self.spec, layout, self.settings)
        fresh.nfe = self.nfe
        return fresh
