"""Uniform-noise canvas decoding (DiffusionGemma), the engine's second loop (registry: "canvas").

Reproduces the generation loop of transformers'
`models/diffusion_gemma/generation_diffusion_gemma.py` (DiffusionGemmaGenerationMixin.generate):
canvases are generated one after another; the prompt, then each finished canvas, is written into
the model's encoder cache; a canvas starts as uniformly random ids and each denoising step

1. runs the decoder over the canvas, self-conditioned on the previous step's logits,
2. scales the logits by a temperature falling linearly from t_max to t_min,
3. draws a token per position and accepts some (entropy bound over all positions, or the
   confidence threshold), re-noising every other position with fresh uniform ids,
4. stops the canvas once its argmax is stable and confident (mean entropy below a threshold).

The canvas appended to the output, and encoded for the next one, is the argmax of the last step, as
in the reference (not the accepted canvas). Differences from the reference: output stops at the
first EOS, which is not returned, and at max_tokens (every canvas is the trained length, as in
the reference, unless min_canvas_length is set below it: then the last canvas is only as long as
the tokens still wanted, at least min_canvas_length); rows of a batch are left-padded and each
draws the noise it would draw alone.
"""

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..decoding import (
    canvas_stats,
    entropy_commit,
    linear_temperature,
    renoise,
    stable_and_confident,
    threshold_commit,
)
from ..decoding.constrained import allowed_tokens, mask_logits
from ..decoding.logprobs import log_probs
from ..settings import SettingsError
from .base import StepEvent, block_event, check_finite
from .constrained import CanvasConstraint
from .logprobs import PositionLogprobs


@dataclass
class CanvasStepEvent(StepEvent):
    """A denoising step. `generated` holds each active row's finished canvases followed by the
    current canvas's argmax (`block` is its span); `pending` (same shape) marks the positions that
    this step did not accept (the threshold sampler: not accepted yet), which the live view
    shades."""

    pending: Optional[mx.array] = None


class CanvasNoise:
    """The canvas's random draws: uniform ids (initial canvas, re-noising) and one uniform number
    per position (the categorical draw). Each row keeps its own stream from `seed` (or its own
    entry of `row_seeds`: the server's rows with seeds of their own) and draws only while it is
    denoising, so a row of a batch sees the draws it would see alone. Tests substitute an object
    with the same two methods to share draws with another implementation."""

    def __init__(self, seed: int, row_seeds: Optional[Sequence[int]] = None):
        self.seed = seed
        self.row_seeds = row_seeds
        self.keys = {}

    def _key(self, row):
        key = self.keys.get(row)
        if key is None:
            key = mx.random.key(self.seed if self.row_seeds is None else self.row_seeds[row])
        key, sub = mx.random.split(key)
        self.keys[row] = key
        return sub

    def ids(self, rows: Sequence[int], length: int, vocab: int) -> mx.array:
        return mx.concatenate(
            [mx.random.randint(0, vocab, (1, length), key=self._key(r)) for r in rows]
        ).astype(mx.int32)

    def uniform(self, rows: Sequence[int], length: int) -> mx.array:
        draws = [mx.random.uniform(shape=(1, length), key=self._key(r)) for r in rows]
        return mx.concatenate(draws)


def _take_rows(cache, idx):
    if getattr(cache, "keys", None) is not None:
        cache.keys, cache.values = cache.keys[idx], cache.values[idx]
    return cache


class CanvasDecoder:
    """Canvas decoding for a batch of prompts (B >= 1, left-padded; rows stop at their own EOS)."""

    # The samplers this loop implements itself, as the reference's acceptance rules over the whole
    # canvas (see _denoise), not through the masked engine's decoding.samplers.COMMIT_RULES: the
    # entropy bound over every position, and the confidence threshold over the unaccepted ones.
    samplers = ("entropy", "threshold")
    # Each row draws from its own stream: rows with different seeds share a run exactly.
    row_seeds = True
    # Structured output: the canvas's readout follows the grammar (constrained.CanvasConstraint).
    takes_constraints = True

    def __init__(
        self,
        model,
        settings: dict,
        eos_token_ids: Sequence[int],
        backend=None,
        images=None,
        row_seeds: Optional[Sequence[int]] = None,
        constraints: Optional[Sequence] = None,
    ):
        self.model = model
        self.constraints = constraints  # one structured.Constraint (or None) per prompt
        self.spec = model.diffusion_spec
        self.s = settings
        if settings["sampler"] not in self.samplers:
            raise ValueError(f"sampler {settings['sampler']!r} has no rule in the canvas decoder")
        if self.spec.vocab_size is None:
            raise TypeError(f"{self.spec.family}: canvas decoding needs DiffusionSpec.vocab_size")
        self.eos = set(int(e) for e in eos_token_ids)
        self.noise = CanvasNoise(settings["seed"], row_seeds)
        # One entry per prompt: the processor's pixel values for that prompt, or None.
        self.images = images
        self.nfe = 0

    def canvas_length(self, remaining: int) -> int:
        s = self.s
        return max(s["min_canvas_length"], min(remaining, s["max_canvas_length"]))

    def run(
        self, prompts: Sequence[Sequence[int]], constraints=None, consumed=None
    ) -> Iterator[object]:
        """Decode `prompts` (left-padded into one batch). `constraints` / `consumed`: each row's
        structured.Constraint (None: unconstrained; default: the decoder's) and the tokens it
        already returned, as MaskedBlockDecoder.run takes them."""
        s, model = self.s, self.model
        constraints = self.constraints if constraints is None else constraints
        self.rules = {}  # row -> CanvasConstraint
        for row, c in enumerate(constraints or ()):
            if c is not None:
                self.rules[row] = CanvasConstraint(c, self.eos, s["max_tokens"])
                if consumed:
                    self.rules[row].matcher.try_consume_tokens(list(consumed[row]))
        pixel_values = None
        if self.images is not None:
            if len(self.images) != len(prompts):
                raise SettingsError(
                    f"{len(self.images)} image entries for {len(prompts)} prompts; give one per "
                    "prompt (None for a prompt without images)"
                )
            # Each row's images go through the tower on their own (its list form), exactly as in
            # a run of that row alone; the features are placed in row order, which is the order
            # of the image tokens in the left-padded batch.
            pixel_values = []
            for p in self.images:
                if isinstance(p, (list, tuple)):  # images of different sizes, one array each
                    pixel_values.extend(p)
                elif p is not None:
                    pixel_values.append(p)
            pixel_values = pixel_values or None
        longest = max(len(p) for p in prompts)
        pads = [longest - len(p) for p in prompts]
        tokens = [[0] * pad + [int(t) for t in p] for pad, p in zip(pads, prompts)]
        tokens = mx.array(tokens, dtype=mx.int32)
        valid = None
        if any(pads):
            valid = mx.arange(longest)[None, :] >= mx.array(pads)[:, None]
        rows = list(range(len(prompts)))
        cache = model.make_cache()
        model.encode(tokens, cache, valid=valid, pixel_values=pixel_values)
        mx.eval([(c.keys, c.values) for c in cache])
        before = mx.zeros((len(rows), 0), dtype=mx.int32)  # finished canvases, for the live view
        total = 0
        while True:
            length = self.canvas_length(s["max_tokens"] - total)
            mask = model.padding_masks(valid, length) if valid is not None else None
            argmax, lp, last = yield from self._denoise(cache, rows, length, mask, before)
            wanted = min(length, s["max_tokens"] - total)
            if last is not None:
                argmax = self._constrained(rows, argmax, last, lp, wanted)
            new, logprobs = self._read(argmax, lp, wanted)
            event = block_event(
                rows,
                new,
                [total + wanted >= s["max_tokens"]] * len(rows),
                self.eos,
                self.nfe,
                logprobs,
            )
            yield event
            total += wanted
            keep = [i for i, f in enumerate(event.finished) if not f]
            if not keep:
                return
            if len(keep) < len(rows):
                # Rows are independent: a finished one leaves the batch and its cache.
                idx = mx.array(keep)
                rows = [rows[i] for i in keep]
                argmax, before = argmax[idx], before[idx]
                valid = valid[idx] if valid is not None else None
                cache = [_take_rows(c, idx) for c in cache]
            if valid is not None:
                valid = mx.concatenate([valid, mx.ones(argmax.shape, dtype=mx.bool_)], axis=1)
            model.encode(argmax, cache, valid=valid)
            mx.eval([(c.keys, c.values) for c in cache])
            before = mx.concatenate([before, argmax], axis=1)

    def _constrained(self, rows, argmax, last, lp, wanted, ranked=32):
        """The canvas with each constrained row's readout made the grammar's (its tokens, and
        with the logprobs setting their log-probabilities, under `last`: each row's last step's
        logits)."""
        picks = {i: r for i, r in enumerate(rows) if r in self.rules}
        idx = mx.array(list(picks))
        scores = last[idx, :wanted]
        top = mx.argpartition(-scores, ranked - 1, axis=-1)[..., :ranked]
        order = mx.argsort(-mx.take_along_axis(scores, top, axis=-1), axis=-1)
        ranks = mx.take_along_axis(top, order, axis=-1).tolist()
        out = np.array(argmax)
        for k, (i, row) in enumerate(picks.items()):

            def best_allowed(pos, words, k=k):
                allowed = allowed_tokens(mx.array(words[None]), scores.shape[-1])[0]
                return int(mx.argmax(mask_logits(scores[k, pos], allowed)).item())

            out[i, :wanted] = self.rules[row].readout(ranks[k], best_allowed, wanted)
        argmax = mx.array(out, dtype=argmax.dtype)
        if lp is not None:
            rows_mask = mx.array([i in picks for i in range(len(rows))])[:, None]
            lp.put(log_probs(last), argmax, rows_mask)
        return argmax

    @staticmethod
    def _read(argmax, lp, wanted):
        """The canvas's first `wanted` tokens, and with the logprobs setting their
        TokenLogprobs: one read."""
        if lp is None:
            return argmax[:, :wanted].tolist(), None
        read = mx.concatenate(
            [argmax[:, :wanted].astype(mx.float32), lp.packed(wanted)], axis=1
        ).tolist()
        new = [[int(t) for t in r[:wanted]] for r in read]
        return new, [lp.unpack(r[wanted:], t) for r, t in zip(read, new)]

    def _draw(self, draw, rows, done, *args):
        """Draws for the rows still denoising; rows that stopped keep their streams untouched."""
        live = [i for i, d in enumerate(done) if not d]
        out = draw([rows[i] for i in live], *args)
        if len(live) == len(rows):
            return out
        full = mx.zeros((len(rows),) + tuple(out.shape[1:]), dtype=out.dtype)
        full[mx.array(live)] = out
        return full

    def _denoise(self, cache, rows: List[int], length: int, mask, before):
        s, model, vocab = self.s, self.model, self.spec.vocab_size
        steps = s["max_denoising_steps"]
        # A canvas cannot be stable for more steps than it runs: a larger stability_threshold
        # stops nothing more, and would size the argmax history (k, B, C) by the setting.
        stability = min(s["stability_threshold"], steps)
        threshold = s["sampler"] == "threshold"
        B = len(rows)
        done = [False] * B
        stopped = mx.zeros((B,), dtype=mx.bool_)
        canvas = self.noise.ids(rows, length, vocab)
        argmax, self_cond, history = canvas, None, None
        revealed = mx.zeros((B, length), dtype=mx.bool_)
        start = before.shape[1]
        all_positions = mx.ones((B, length), dtype=mx.bool_)
        # The canvas is the argmax of each row's last step: its log-probabilities are that step's.
        lp = None
        if s.get("logprobs") is not None:
            lp = PositionLogprobs(s["logprobs"], (), B, length)
        # Constrained rows read their canvas out of the last step's logits (a stopped row keeps
        # those of its last step).
        constrained = any(r in self.rules for r in rows)
        last = None
        for remaining in range(steps, 0, -1):
            temperature = linear_temperature(remaining, steps, s["t_min"], s["t_max"])
            logits = model.decode(canvas, cache, self_cond, mask=mask)
            if constrained:
                last = logits if last is None else mx.where(stopped[:, None, None], last, logits)
            self.nfe += 1
            if self.nfe == 1:  # the run's first forward: corrupt weights show here (one sync)
                check_finite(logits, model)
            uniform = self._draw(self.noise.uniform, rows, done, length)
            st = canvas_stats(logits, temperature, uniform)
            if threshold:
                candidates = ~revealed
                if remaining == 1:
                    accept = candidates  # the last step accepts whatever is left
                else:
                    accept = threshold_commit(st.confidence, candidates, s["threshold"])
                keep = revealed | accept
            else:
                accept = keep = entropy_commit(st.entropy, all_positions, s["entropy_bound"])
            accepted = mx.where(accept, st.sample, canvas)
            fresh = self._draw(self.noise.ids, rows, done, length, vocab)
            new_canvas = renoise(accepted, keep, fresh)
            new_argmax, processed = st.argmax, st.processed
            if any(done):
                # A row that has stopped keeps its canvas, argmax and self-conditioning.
                frozen = stopped[:, None]
                new_argmax = mx.where(frozen, argmax, new_argmax)
                new_canvas = mx.where(frozen, canvas, new_canvas)
                processed = mx.where(frozen[..., None], self_cond, processed)
                if threshold:
                    keep = mx.where(frozen, revealed, keep)
            if lp is not None:  # a row that has stopped keeps its last step's
                lp.put(log_probs(logits), new_argmax, ~stopped[:, None])
            stop, history = stable_and_confident(
                history, new_argmax, st.entropy, stability, s["confidence_threshold"]
            )
            if threshold:
                stop = stop | keep.all(axis=-1)
                revealed = keep
            stopped = stopped | stop
            canvas, argmax, self_cond = new_canvas, new_argmax, processed
            state = (canvas, argmax, self_cond, stopped, revealed, history)
            mx.eval([a for a in state if a is not None])
            done = stopped.tolist()
            pending = ~keep & ~stopped[:, None]  # a canvas that has stopped is final
            pending = mx.concatenate([mx.zeros(before.shape, dtype=mx.bool_), pending], axis=1)
            generated = mx.concatenate([before, argmax], axis=1)
            yield CanvasStepEvent(list(rows), generated, (start, start + length), self.nfe, pending)
            if all(done):
                break
        return argmax, lp, last
