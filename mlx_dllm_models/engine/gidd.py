"""GIDD's block-wise denoising (registry: "gidd"), the loop of GiddForDiffusionLM.generate
(dvruette/gidd-easydel, gidd_easydel/model/modeling_gidd_hf.py).

The canvas spans the model's context (max_position_embeddings): the prompt, then the noise prior
(uniform ids and / or masks, decoding.gidd.prior) to the end. Blocks of block_length after the
prompt are denoised in turn; for each block

1. one forward over the clean prefix (prompt and finished blocks, attending to each other only)
   keeps its K/V;
2. each of `steps` steps (log-SNR from the noisiest to the cleanest) runs the rest of the canvas
   (the block and the noise after it, attending to everything) against those K/V, with the mask
   id's logit at -inf, and redraws the block (sampler `ancestral`) or changes `tokens_per_step`
   of its positions (`adaptive`); a step that changed nothing in any row of the batch reuses its
   logits instead of running a forward, as the reference does;
3. a row stops after a block once its canvas holds an EOS anywhere (the reference's test, which
   reads the prompt and the noise too), or once max_tokens are decoded.

A row's text is its decoded blocks, cut before the first EOS among them (the reference pads from
the first EOS on). Rows of a batch are grouped by prompt length (positions are absolute, so rows
of one length share every forward) and each draws from its own stream (CanvasNoise), so a row
decodes as it would alone; a cancelled row leaves before the next step.
"""

from typing import Dict, Iterator, List

import mlx.core as mx

from ..decoding.gidd import (
    adaptive_positions,
    ancestral_probs,
    draw,
    log_snr_schedule,
    prior,
    token_probs,
)
from ..decoding.stats import without
from ..settings import SettingsError
from .base import StepEvent, block_event, check_finite
from .canvas import CanvasNoise
from .contracts import Decoder, DecoderInputs, Prompts, Rows


class GiddDecoder(Decoder):
    """GIDD's denoising for a batch of prompts."""

    samplers = ("ancestral", "adaptive")

    @classmethod
    def draws(cls, spec, settings) -> bool:
        """A GIDD canvas starts from its noise prior, drawn from the row's stream."""
        return bool(spec.noise_log_snr)

    row_seeds = True
    drops_cancelled_rows = True

    def __init__(self, model, inputs: DecoderInputs, backend: None = None):
        self.model = model
        self.spec = spec = inputs.spec
        self.s = settings = inputs.settings
        if settings.sampler not in self.samplers:
            raise SettingsError(
                f"sampler {settings.sampler!r} has no rule in GIDD's decoder; choose one of: "
                + ", ".join(self.samplers)
            )
        if settings.logprobs is not None:
            raise SettingsError("the gidd decoder does not report logprobs; leave logprobs unset")
        if not spec.noise_log_snr or spec.vocab_size is None or not spec.max_position_embeddings:
            raise TypeError(f"{spec.family}: GIDD decoding needs the spec's noise and sizes")
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        self.noise = CanvasNoise(settings.seed, inputs.row_seeds)
        self.nfe = 0

    def run(
        self, prompts: Prompts, *, cancelled: Rows = frozenset(), constraints=None, consumed=None
    ) -> Iterator[object]:
        groups: Dict[int, List[int]] = {}
        for row, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(row)
        for rows in groups.values():
            yield from self._group(rows, [list(prompts[r]) for r in rows], cancelled)

    def _group(self, rows, prompts, cancelled) -> Iterator[object]:
        s, spec = self.s, self.spec
        total, vocab, mask_id = spec.max_position_embeddings, spec.vocab_size, spec.mask_token_id
        min_snr, max_snr, noise_type = spec.noise_log_snr
        P = len(prompts[0])
        if P < 1 or P >= total:
            raise SettingsError(
                f"a GIDD prompt needs 1 to {total - 1} tokens (its canvas spans the context, "
                f"max_position_embeddings {total}); got {P}"
            )
        end = min(P + s.max_tokens, total)
        noisy = self.noise.uniform(rows, total - P)
        ids = self.noise.ids(rows, total - P, vocab)
        x = mx.concatenate(
            [mx.array(prompts, dtype=mx.int32), prior(noisy, ids, min_snr, noise_type, mask_id)],
            axis=1,
        )
        log_snrs = log_snr_schedule(s.steps, s.noise_schedule, min_snr, max_snr)
        start = P
        while rows:
            stop = min(start + s.block_length, total)
            cache = self.model.prefix_cache()
            self.model(x[:, :start], cache=cache)
            mx.eval([(c.keys, c.values) for c in cache])
            self.nfe += 1
            logits = None
            for step in range(s.steps, 0, -1):
                keep = [i for i, r in enumerate(rows) if r not in cancelled]
                if not keep:
                    return
                if len(keep) < len(rows):
                    idx = mx.array(keep)
                    rows, x = [rows[i] for i in keep], x[idx]
                    for c in cache:
                        c.select(idx)
                    logits = None if logits is None else logits[idx]
                if logits is None:
                    logits = self._logits(x, start, stop, cache)
                z_t = x[:, start:stop]
                z_s = self._step(rows, z_t, logits, log_snrs, step)
                x[:, start:stop] = z_s
                changed = mx.any(z_s != z_t)
                mx.eval(x, changed)
                if changed.item():
                    logits = None
                yield StepEvent(list(rows), x[:, P:end], (start - P, stop - P), self.nfe)
            limit = stop >= end
            at_limit = [limit] * len(rows)
            if self.eos:
                eos = mx.array(sorted(self.eos))
                found = mx.any(x[..., None] == eos, axis=(1, 2)).tolist()
                at_limit = [limit or bool(f) for f in found]
            new = x[:, start : min(stop, end)].tolist()
            event = block_event(rows, new, at_limit, self.eos, self.nfe)
            yield event
            keep = [i for i, f in enumerate(event.finished) if not f and rows[i] not in cancelled]
            if len(keep) < len(rows):
                rows = [rows[i] for i in keep]
                x = x[mx.array(keep)] if keep else x[:0]
            start = stop

    def _logits(self, x, start, stop, cache) -> mx.array:
        """The block's float32 logits from a forward over the rest of the canvas, the mask id's
        at -inf."""
        logits = self.model(x[:, start:], cache=cache, head_span=(0, stop - start))
        self.nfe += 1
        if self.nfe == 2:  # the run's first window forward: corrupt weights show here
            check_finite(logits, self.model)
        return without(logits.astype(mx.float32), [self.spec.mask_token_id])

    def _step(self, rows, z, logits, log_snrs, step: int) -> mx.array:
        s, spec = self.s, self.spec
        _, _, noise_type = spec.noise_log_snr
        mask_id, temperature = spec.mask_token_id, s.temperature
        top_k, top_p = s.top_k, s.top_p
        if s.sampler == "ancestral":
            x_hat = token_probs(logits, temperature, top_k, top_p)
            weights = ancestral_probs(
                z, x_hat, (log_snrs[step], log_snrs[step - 1]), noise_type, mask_id
            )
            return draw(weights, self.noise.uniform(rows, z.shape[1]))
        picked = adaptive_positions(
            z, logits, log_snrs[step], noise_type, mask_id, s.tokens_per_step
        )
        if temperature == 0:
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            probs = token_probs(logits, temperature, top_k, top_p)
            tokens = draw(probs, self.noise.uniform(rows, z.shape[1]))
        return mx.where(picked, tokens, z)
