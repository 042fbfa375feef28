"""Exact prefix KV cache for block-causal families (SDAR, SDAR-MoE, TraDo, LLaDA2.x).

Under the block-causal mask a query in block b sees blocks <= b only, so a finished block's K/V
never change: they are computed once and read by every later step. Per denoising step the model
runs over the open block only (block_length queries against the cached prefix) instead of the
whole window.

* Prefill: the prompt's whole blocks, in chunks of whole blocks. The prompt's unaligned tail
  shares the first generation block and is re-encoded with it (never changed: it is not a
  candidate).
* Commit folding: the K/V a block's denoising steps wrote were computed before its last tokens
  were committed. Instead of a separate forward over the finished block (SDAR's `store_kv`
  forward, mlx-vlm's commit forward), the next block's first forward starts at the finished
  block: [block b final tokens ; block b+1] under the block-causal mask gives block b's final K/V
  exactly (its queries never see block b+1), and block b+1's logits. The last block needs no
  commit at all. `commits_saved` counts the forwards this avoids (one per finished block).

Token-identical at temperature 0 to `FullRecompute` (the whole window under the block-causal mask
every step), which is what the family references do.

Families whose logits are shifted and whose blocks start from a token (Fast-dLLM v2: the spec's
`logit_shift=1`, `seeds_block_start`) fold no commit: the next block's first token is the argmax
of the finished block's last logit, so `begin_block` runs the finished block's forward (its final
K/V, the reference's `update_past_key_values` forward) and places that token before the block's
first denoising step, which then runs over the block alone.
"""

from typing import List

import mlx.core as mx

from ..cache import PrefixKVCache, PriorKV
from ..decoding.logprobs import log_probs
from ..decoding.stats import without
from ..masks import block_causal_mask
from .base import replaced
from .contracts import Backend, ExactRestarts

# Prompt blocks per prefill forward: about this many tokens, rounded down to whole blocks.
PREFILL_TOKENS = 512


def seed_block_start(backend, x, logits, start):
    """`spec.seeds_block_start`: column `start` (a block's first), where a row decodes it, takes the
    argmax of `logits` (B, V), the previous position's over the finished prefix (never the mask).
    With the logprobs setting, the backend's `seed_log_probs` are that position's (masked.py)."""
    spec, decoded = backend.spec, backend.decoded
    seed = mx.argmax(without(logits, (spec.mask_token_id, *spec.suppressed_token_ids)), -1)
    if backend.settings.logprobs is not None:
        backend.seed_log_probs = log_probs(logits)
    put = decoded[:, start] & (x[:, start] == spec.mask_token_id)
    x[:, start] = mx.where(put, seed.astype(x.dtype), x[:, start])
    return x


def seeds_at(spec, block: int, start: int) -> bool:
    """Whether a block starting at column `start` takes a seed: block-aligned and not the first
    column (a first block that starts inside the prompt's last block has none)."""
    return spec.seeds_block_start and start % block == 0 and start > 0


class PrefixCache(ExactRestarts, Backend):
    """Backend of the masked block engine (see full_recompute.py for the interface)."""

    # A denoising step's forward over some rows may run on `select(layout, rows)`: its K/V of the
    # open block are rewritten by every step and made final by the next block's folded forward,
    # which runs over every row.
    row_steps = True
    # A restart over [prompt ; committed] (the server's joins) re-encodes the committed blocks
    # into K/V equal to those cached: blocks stay on their absolute positions, since block-causal
    # padding is a multiple of the block length.
    join_reencodes = True
    resumes = True

    def __init__(self, model, spec, layout, settings):
        if not layout.aligned:
            raise ValueError(
                "the prefix cache needs a block-aligned layout (block-causal families)"
            )
        self.model, self.spec, self.settings = model, spec, settings
        self.block = settings.block_length
        self.width = layout.width
        self.pads = list(layout.pads) if any(layout.pads) else None
        self.on_columns = layout.prompt_end  # dllm's BD3LM: blocks end at the prompt's end
        self.ends = layout.right_ends
        self.cache = PrefixKVCache(len(model.layers), layout.width, self.pads)
        # The first column of the first block that holds a generated position of some row.
        self.prefix = (min(layout.starts) // self.block) * self.block
        self.nfe = 0
        self.reused = 0  # prompt columns whose K/V came from an earlier run (resume)
        self.prefill_forwards = 0
        self.commits_folded = 0  # finished blocks whose K/V came with the next block's forward
        self.commits_saved = 0  # commit forwards avoided: one per finished block
        self.shift = spec.logit_shift
        self.decoded = layout.decoded
        self.last = None  # (B, V) the prefill's last logits: a block-aligned first block's seed
        self.seed_log_probs = None

    def _forward(self, x, start, stop, head_span):
        self.nfe += 1
        if (
            self.pads is None
            and self.ends is None
            and start % self.block == 0
            and stop - start <= self.block
        ):
            # One block against its prefix: every key is visible. No mask lets attention take
            # its unmasked path (the usual denoising step).
            mask = None
        else:
            mask = block_causal_mask(
                stop - start,
                self.block,
                start,
                left_padding=self.pads,
                on_columns=self.on_columns,
                ends=self.ends,
            )
        return self.model(
            x[:, start:stop], cache=self.cache.at(start), mask=mask, head_span=head_span
        )

    def prefill(self, x, first=0):
        chunk = max(1, PREFILL_TOKENS // self.block) * self.block
        for start in range(first, self.prefix, chunk):
            stop = min(start + chunk, self.prefix)
            # Only the K/V are wanted: the head runs over one row (not zero rows: mlx's
            # quantized matmul dies with SIGFPE on an empty input, as a 4-bit head would get).
            out = self._forward(x, start, stop, head_span=(stop - start - 1, stop - start))
            mx.eval(out, [(c.keys, c.values) for c in self.cache])
            self.prefill_forwards += 1
            self.cache.commit(stop)
            self.last = out[:, -1]

    def resume(self, x, prior: PriorKV):
        """prefill, reusing `prior`'s K/V over the whole blocks the prompt shares with it: a
        block's K/V depend on its own tokens and the blocks before it only."""
        prior.check(self._kind())
        # A seeded first block needs the prefill's last logit: its block is computed again.
        seeded = seeds_at(self.spec, self.block, self.prefix)
        limit = self.prefix - self.block if seeded else self.prefix
        keep = prior.shared(x[0].tolist(), self.block, limit=limit)
        self.cache = prior.cache_for(self.width, keep)
        self.reused = keep
        self.prefill(x, first=keep)

    def kv_prefix(self, x) -> PriorKV:
        if self.on_columns:
            # Blocks that end at the prompt's end move with its length: a longer prompt that
            # continues this one puts the shared tokens on other blocks, so no K/V carry over.
            return None
        committed = self.cache.committed
        return PriorKV(x[0, :committed].tolist(), self.cache, self._kind())

    def _kind(self):
        return self.kv_kind(self.settings)

    @classmethod
    def kv_kind(cls, settings) -> str:
        """The PriorKV.kind a run under these settings leaves and can resume from: block-causal
        K/V depend on the block partition."""
        return f"block-causal (block_length {settings.block_length})"

    def begin_block(self, x, start, stop):
        if not seeds_at(self.spec, self.block, start):
            return x
        first = self.cache.committed
        last = self.last
        if first < start:
            # The finished blocks' final K/V; their last logit seeds this block.
            out = self._forward(x, first, start, head_span=(start - first - 1, start - first))
            self.cache.commit(start)
            self.commits_saved -= (start - first) // self.block
            last = out[:, -1]
        return seed_block_start(self, x, last, start)

    def block_logits(self, x, start, stop):
        block_start = (start // self.block) * self.block
        block_stop = min(block_start + self.block, self.width)
        # Every finished block not yet committed rides along with this forward.
        first = self.cache.committed
        lo, hi = start - first - self.shift, stop - first - self.shift
        logits = self._forward(x, first, block_stop, head_span=(max(lo, 0), hi))
        if lo < 0:
            # A shifted window that starts the forward: its first column is read at itself, as
            # the reference's cat([logits[:, :1], logits[:, :-1]]); it holds the block's seed,
            # which no step decides.
            logits = mx.concatenate([logits[:, :1], logits], axis=1)
        if first < block_start:
            self.commits_folded += (block_start - first) // self.block
            self.cache.commit(block_start)
        return logits

    def end_block(self, x, start, stop):
        self.commits_saved += 1

    def select(self, layout, idx: List[int]):
        pads = list(layout.pads) if any(layout.pads) else None
        rows = mx.array(idx)
        return replaced(
            self,
            pads=pads,
            ends=layout.right_ends,
            cache=self.cache.select(idx, pads),
            decoded=layout.decoded,
            last=None if self.last is None else self.last[rows],
            seed_log_probs=None if self.seed_log_probs is None else self.seed_log_probs[rows],
        )
