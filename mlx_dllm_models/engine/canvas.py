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

A row leaves the batch when it finishes (at a canvas's end) or, through `run(cancelled=)`, before
the next denoising step: its encoder K/V, canvas, self-conditioning, stopping history and noise
stream go, and the other rows, which never read them, decode on as a smaller batch.
"""

from dataclasses import dataclass
from typing import AbstractSet, Iterator, List, Optional, Sequence

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
from .base import StepEvent, block_event, check_finite, placed
from .constrained import CanvasConstraint
from .contracts import Decoder, DecoderInputs, Prompts, Rows
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


@dataclass
class _Rows:
    """The rows still decoding (their indices among the prompts) and what each keeps across
    canvases: its encoder K/V, which encoded positions are real (None: no padding), the finished
    canvases (for the live view)."""

    rows: List[int]
    cache: list
    valid: Optional[mx.array]
    before: mx.array

    def select(self, keep: List[int]) -> None:
        idx = mx.array(keep)
        self.rows = [self.rows[i] for i in keep]
        self.cache = [_take_rows(c, idx) for c in self.cache]
        self.valid = None if self.valid is None else self.valid[idx]
        self.before = self.before[idx]


@dataclass
class _Canvas:
    """A canvas's denoising state, per row: its current noisy canvas, the argmax of its last
    step, the self-conditioning logits, the argmax history of the stopping rule, the positions
    accepted (threshold sampler), which rows have stopped (device and host), and with the logprobs
    setting or a constraint, the last step's log-probabilities / logits."""

    canvas: mx.array
    argmax: mx.array
    revealed: mx.array
    stopped: mx.array
    done: List[bool]
    self_cond: Optional[mx.array] = None
    history: Optional[mx.array] = None
    lp: Optional[PositionLogprobs] = None
    last: Optional[mx.array] = None
    confidence: Optional[mx.array] = None  # the last step's, of each position's draw

    def select(self, keep: List[int]) -> None:
        idx = mx.array(keep)
        for name in ("canvas", "argmax", "revealed", "stopped", "self_cond", "last", "confidence"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else value[idx])
        self.history = None if self.history is None else self.history[:, idx]
        self.done = [self.done[i] for i in keep]
        if self.lp is not None:
            self.lp.select(keep)


class CanvasDecoder(Decoder):
    """Canvas decoding for a batch of prompts (B >= 1, left-padded; rows stop at their own EOS)."""

    # The samplers this loop implements itself, as the reference's acceptance rules over the whole
    # canvas (see _denoise), not through the masked engine's decoding.samplers.commit_rule: the
    # entropy bound over every position, and the confidence threshold over the unaccepted ones.
    samplers = ("entropy", "threshold")
    # Each row draws from its own stream: rows with different seeds share a run exactly.
    row_seeds = True
    # Structured output: the canvas's readout follows the grammar (constrained.CanvasConstraint).
    takes_constraints = True
    # `run(cancelled=)` drops a cancelled row before the next denoising step.
    drops_cancelled_rows = True
    # Its encoder reads each row's images (DecoderInputs.pixel_values).
    reads_images = True

    @classmethod
    def draws(cls, spec, settings) -> bool:
        """Every canvas starts from uniform noise drawn from the row's stream."""
        return True

    def __init__(self, model, inputs: DecoderInputs, backend: None = None):
        self.model = model
        self.constraints = inputs.constraints  # one structured.Constraint (or None) per prompt
        self.spec = inputs.spec
        self.s = settings = inputs.settings
        if settings.sampler not in self.samplers:
            raise ValueError(f"sampler {settings.sampler!r} has no rule in the canvas decoder")
        if self.spec.vocab_size is None:
            raise TypeError(f"{self.spec.family}: canvas decoding needs DiffusionSpec.vocab_size")
        self.eos = set(int(e) for e in inputs.eos_token_ids)
        self.noise = CanvasNoise(settings.seed, inputs.row_seeds)
        # One entry per prompt: the processor's pixel values for that prompt, or None.
        self.images = inputs.pixel_values
        self.nfe = 0

    def canvas_length(self, remaining: int) -> int:
        s = self.s
        return max(s.min_canvas_length, min(remaining, s.max_canvas_length))

    def run(
        self, prompts: Prompts, *, cancelled: Rows = frozenset(), constraints=None, consumed=None
    ) -> Iterator[object]:
        """Decode `prompts` (left-padded into one batch). `constraints` / `consumed`: each row's
        structured.Constraint (None: unconstrained; default: the decoder's) and the tokens it
        already returned, as MaskedBlockDecoder.run takes them. `cancelled`: a set of row indices
        the caller may grow while the run goes on (between two of its events); a row in it leaves
        the batch before the next denoising step, with no further event, and the other rows'
        tokens are those of a run without it (each draws from its own noise stream). A run whose
        rows are all cancelled ends."""
        s, model = self.s, self.model
        constraints = self.constraints if constraints is None else constraints
        self.rules = {}  # row -> CanvasConstraint
        for row, c in enumerate(constraints or ()):
            if c is not None:
                self.rules[row] = CanvasConstraint(c, self.eos, s.max_tokens)
                if consumed:
                    self.rules[row].matcher.try_consume_tokens(list(consumed[row]))
        batch = self._encode_prompts(prompts)
        total = 0
        while True:
            length = self.canvas_length(s.max_tokens - total)
            state = yield from self._denoise(batch, length, cancelled)
            if state is None:  # every row was cancelled
                return
            argmax, wanted = state.argmax, min(length, s.max_tokens - total)
            if state.last is not None:
                argmax = self._constrained(batch.rows, argmax, state.last, state.lp, wanted)
            new, logprobs = self._read(argmax, state.lp, wanted)
            rows = batch.rows
            at_limit = [total + wanted >= s.max_tokens] * len(rows)
            event = block_event(rows, new, at_limit, self.eos, self.nfe, logprobs)
            yield event
            total += wanted
            keep = [i for i, f in enumerate(event.finished) if not f and rows[i] not in cancelled]
            if not keep:
                return
            if len(keep) < len(rows):
                # Rows are independent: a finished one leaves the batch and its cache.
                batch.select(keep)
                argmax = argmax[mx.array(keep)]
            if batch.valid is not None:
                batch.valid = mx.concatenate(
                    [batch.valid, mx.ones(argmax.shape, dtype=mx.bool_)], axis=1
                )
            model.encode(argmax, batch.cache, valid=batch.valid)
            mx.eval([(c.keys, c.values) for c in batch.cache])
            batch.before = mx.concatenate([batch.before, argmax], axis=1)

    def _encode_prompts(self, prompts) -> _Rows:
        """The prompts, left-padded, through the encoder (with each row's images): the rows."""
        model = self.model
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
        cache = model.make_cache()
        model.encode(tokens, cache, valid=valid, pixel_values=pixel_values)
        mx.eval([(c.keys, c.values) for c in cache])
        # Finished canvases, for the live view.
        return _Rows(list(range(len(prompts))), cache, valid, mx.zeros((len(prompts), 0), mx.int32))

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

    def _denoise(self, batch: _Rows, length: int, cancelled: AbstractSet[int]):
        """One canvas: yields a CanvasStepEvent per denoising step, returns its final _Canvas
        (None once every row was cancelled)."""
        s, model, vocab = self.s, self.model, self.spec.vocab_size
        steps = s.max_denoising_steps
        B = len(batch.rows)
        canvas = self.noise.ids(batch.rows, length, vocab)
        st = _Canvas(
            canvas, canvas, mx.zeros((B, length), mx.bool_), mx.zeros((B,), mx.bool_), [False] * B
        )
        # The canvas is the argmax of each row's last step: its log-probabilities are that step's.
        if s.logprobs is not None:
            st.lp = PositionLogprobs(s.logprobs, (), B, length)
        # Constrained rows read their canvas out of the last step's logits (a stopped row keeps
        # those of its last step).
        constrained = any(r in self.rules for r in batch.rows)
        mask = None
        for remaining in range(steps, 0, -1):
            keep = [i for i, r in enumerate(batch.rows) if r not in cancelled]
            if not keep:
                return None
            if len(keep) < len(batch.rows) or mask is None:
                if len(keep) < len(batch.rows):  # cancelled rows leave before this step
                    batch.select(keep)
                    st.select(keep)
                if batch.valid is not None:
                    mask = model.padding_masks(batch.valid, length)
            logits = model.decode(st.canvas, batch.cache, st.self_cond, mask=mask)
            if constrained:
                stopped = st.stopped[:, None, None]
                st.last = logits if st.last is None else mx.where(stopped, st.last, logits)
            self.nfe += 1
            if self.nfe == 1:  # the run's first forward: corrupt weights show here (one sync)
                check_finite(logits, model)
            keep = self._step(st, batch.rows, logits, remaining)
            st.done = st.stopped.tolist()
            pending = ~keep & ~st.stopped[:, None]  # a canvas that has stopped is final
            pending = mx.concatenate([mx.zeros(batch.before.shape, mx.bool_), pending], axis=1)
            generated = mx.concatenate([batch.before, st.argmax], axis=1)
            start = batch.before.shape[1]
            span = (start, start + length)
            conf = None if st.confidence is None else placed(st.confidence, start, start + length)
            yield CanvasStepEvent(list(batch.rows), generated, span, self.nfe, conf, pending)
            if all(st.done):
                break
        return st

    def _step(self, st: _Canvas, rows, logits, remaining: int):
        """A denoising step's draws, acceptance and re-noising, and the stopping rule, from its
        `logits` (`remaining`: steps left, this one included): `st` updated (evaluated); returns
        the positions kept (accepted or revealed)."""
        s, vocab = self.s, self.spec.vocab_size
        steps, length = s.max_denoising_steps, st.canvas.shape[1]
        temperature = linear_temperature(remaining, steps, s.t_min, s.t_max)
        # A canvas cannot be stable for more steps than it runs: a larger stability_threshold
        # stops nothing more, and would size the argmax history (k, B, C) by the setting.
        stability = min(s.stability_threshold, steps)
        threshold = s.sampler == "threshold"
        uniform = self._draw(self.noise.uniform, rows, st.done, length)
        stats = canvas_stats(logits, temperature, uniform)
        if threshold:
            candidates = ~st.revealed
            if remaining == 1:  # the last step accepts whatever is left
                accept = candidates
            else:
                accept = threshold_commit(stats.confidence, candidates, s.threshold)
            keep = st.revealed | accept
        else:
            everywhere = mx.ones(st.canvas.shape, dtype=mx.bool_)
            accept = keep = entropy_commit(stats.entropy, everywhere, s.entropy_bound)
        accepted = mx.where(accept, stats.sample, st.canvas)
        if self.step_confidence:
            st.confidence = stats.confidence
        fresh = self._draw(self.noise.ids, rows, st.done, length, vocab)
        new_canvas = renoise(accepted, keep, fresh)
        new_argmax, processed = stats.argmax, stats.processed
        if any(st.done):
            # A row that has stopped keeps its canvas, argmax and self-conditioning.
            frozen = st.stopped[:, None]
            new_argmax = mx.where(frozen, st.argmax, new_argmax)
            new_canvas = mx.where(frozen, st.canvas, new_canvas)
            processed = mx.where(frozen[..., None], st.self_cond, processed)
            if threshold:
                keep = mx.where(frozen, st.revealed, keep)
        if st.lp is not None:  # a row that has stopped keeps its last step's
            st.lp.put(log_probs(logits), new_argmax, ~st.stopped[:, None])
        stop, st.history = stable_and_confident(
            st.history, new_argmax, stats.entropy, stability, s.confidence_threshold
        )
        if threshold:
            stop = stop | keep.all(axis=-1)
            st.revealed = keep
        st.stopped = st.stopped | stop
        st.canvas, st.argmax, st.self_cond = new_canvas, new_argmax, processed
        state = (st.canvas, st.argmax, st.self_cond, st.stopped, st.revealed, st.history)
        mx.eval([a for a in state if a is not None])
        return keep
