"""The text-to-image loop of the unified families (MMaDA's t2i_generate, Lumina-DiMOO's
generate_image): every step one forward over the whole prompt (with the unconditional rows beside
the conditional ones under guidance), the image columns' codebook logits, then the step rule the
image spec names (STEP_RULES: decoding.maskgit's or decoding.gumbel_maskgit's).

The token layout is the caller's (images.py builds an ImageRows): each row is its text part (`text_len` columns,
left-padded), then the image part, whose N image columns sit at `columns` (by default the N
columns before the last). The unconditional rows keep their own text part and take the
conditional rows' current image part at every step, as both references rebuild them.

Draws: each row draws its uniforms from its own key (split once per step), so a row of a batch
samples as it would alone; tests inject the reference's draws instead (`draws`). A rule whose
sampling takes a uniform per codebook entry (gumbel-max) draws (B, N, C) of them.
"""

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..decoding.gumbel_maskgit import gumbel_max_step
from ..decoding.maskgit import MaskGitState, guided, maskgit_step
from ..decoding.stats import uniform
from ..masks import padding_mask
from .base import split_rows

# step -> (sampling uniforms (B, N), or (B, N, C) for gumbel-max; gumbel uniforms (B, N))
Draws = Callable[[int], Tuple[mx.array, mx.array]]


# ImageSpec.rule -> (the step, whether its sampling draws a uniform per codebook entry)
STEP_RULES = {"muse": (maskgit_step, False), "gumbel_max": (gumbel_max_step, True)}


class Unconditional(NamedTuple):
    """Unconditional twins of a batch's rows: their text parts (B, text_len), left paddings, and
    guidance scale (None: the run's guidance_scale)."""

    prefix: mx.array
    pads: Sequence[int]
    scale: Optional[float] = None


@dataclass
class ImageRows:
    """A batch's token layout (images.py builds it): the rows (B, L), their left paddings, the
    text part's width, the image columns (None: the N before the last), and the unconditional
    twins guidance runs beside them (Lumina-DiMOO's editing guides against the prompt without the
    image too, `c + g (c - u) + g_img (c - u_img)`)."""

    ids: mx.array
    pads: List[int]
    text_len: int
    columns: Optional[Sequence[int]] = None
    uncond: List[Unconditional] = field(default_factory=list)


@dataclass
class ImageStep:
    """What a step leaves: every position's sampled codebook index and the positions masked again
    (the last step's `sampled` is the image)."""

    step: int
    steps: int
    sampled: mx.array
    masking: mx.array


def seeded_draws(seeds: Sequence[int], n_tokens: int, entries: Optional[int] = None) -> Draws:
    """Per-row draws from `seeds` (row b from its own key); the sampling uniforms (B, N, entries)
    when `entries` is given."""
    state = {"keys": mx.stack([mx.random.key(int(s)) for s in seeds])}
    shape = (len(seeds), n_tokens)
    sample_shape = shape if entries is None else shape + (entries,)

    def draws(step: int):
        state["keys"], sample_keys, gumbel_keys = split_rows(state["keys"], 3)
        return uniform(sample_keys, sample_shape), uniform(gumbel_keys, shape)

    return draws


class ImageDecoder:
    """One run of text-to-image decoding over a batch of prompts laid out as described above."""

    def __init__(
        self,
        model,
        rows: ImageRows,
        *,
        n_tokens: int,
        offset: int,
        codebook_size: int,
        mask_token_id: int,
        rule: str = "muse",
    ):
        self.model = model
        self.ids = rows.ids
        self.pads = list(rows.pads)
        self.text_len = rows.text_len
        self.uncond = list(rows.uncond)
        self.n_tokens = n_tokens
        self.offset = offset
        self.codebook_size = codebook_size
        self.mask_token_id = mask_token_id
        ids, columns = rows.ids, rows.columns
        L = ids.shape[1]
        if columns is None:
            columns = range(L - n_tokens - 1, L - 1)
        columns = [int(c) for c in columns]
        if len(columns) != n_tokens:
            raise ValueError(f"{len(columns)} image columns for {n_tokens} image tokens")
        self.columns = mx.array(columns, dtype=mx.int32)
        self.span = (columns[0], columns[-1] + 1)
        # The head runs over the span; where other tokens sit between the image columns
        # (Lumina-DiMOO's row ends), the columns are gathered from it.
        self.gather = None
        if columns != list(range(*self.span)):
            self.gather = self.columns - columns[0]
        self.step_rule = STEP_RULES[rule][0]
        self.nfe = 0

    def logits(self, guidance_scale: float) -> mx.array:
        """(B, N, C) guided codebook logits of the image columns."""
        B, L = self.ids.shape
        uncond = [
            (u.prefix, u.pads, guidance_scale if u.scale is None else u.scale) for u in self.uncond
        ]
        if not any(scale > 0 for _, _, scale in uncond):
            uncond = []
        image = self.ids[:, self.text_len :]
        batch = mx.concatenate(
            [self.ids] + [mx.concatenate([prefix, image], axis=1) for prefix, _, _ in uncond]
        )
        pads = self.pads + [p for _, row_pads, _ in uncond for p in row_pads]
        logits = self.model(batch, mask=padding_mask(pads, L), head_span=self.span)
        self.nfe += 1
        if self.gather is not None:
            logits = mx.take(logits, self.gather, axis=1)
        logits = logits[..., self.offset : self.offset + self.codebook_size].astype(mx.float32)
        if not uncond:
            return logits
        if len(uncond) == 1:
            return guided(logits[:B], logits[B:], uncond[0][2])
        cond = logits[:B]
        out = cond
        for i, (_, _, scale) in enumerate(uncond, start=1):
            out = out + scale * (cond - logits[i * B : (i + 1) * B])
        return out

    def run(
        self, *, steps: int, guidance_scale: float, temperature: float, draws: Draws
    ) -> Iterator[ImageStep]:
        # Columns that hold an image token are given (inpainting) and kept, as the reference's
        # unknown_map reads them from input_ids.
        columns = mx.take(self.ids, self.columns, axis=1)
        known = columns != self.mask_token_id
        initial = (~known).sum(axis=-1)
        tokens = mx.where(known, columns - self.offset, 0).astype(mx.int32)
        for step in range(steps):
            u_sample, u_gumbel = draws(step)
            state = MaskGitState(tokens, known, step, steps, temperature, initial)
            sampled, masking, temperature = self.step_rule(
                self.logits(guidance_scale), state, u_sample, u_gumbel
            )
            image = mx.where(masking, self.mask_token_id, sampled + self.offset)
            ids = mx.array(self.ids)
            ids[:, self.columns] = image.astype(ids.dtype)
            self.ids = ids
            tokens, known = sampled, ~masking
            mx.eval(self.ids, tokens, known)
            yield ImageStep(step, steps, sampled, masking)
