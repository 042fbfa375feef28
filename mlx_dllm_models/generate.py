"""Public API: generate_diffusion, stream_generate_diffusion, batch_generate_diffusion (and load,
from loader.py).

Mirrors mlx-lm's generate / stream_generate: a prompt is text (tokenized as mlx-lm does, no chat
template) or a list of token ids; generation stops at an EOS, which is not returned
(finish_reason "stop"), else at max_tokens (finish_reason "length").
"""

import numbers
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .engine import BlockEvent, make_decoder
from .errors import CheckpointError
from .settings import GENERATION_CONFIG_KEYS, SettingsError, resolve_settings
from .spec import BIDIRECTIONAL
from .vision import encode_prompt, is_processor, text_tokenizer

Prompt = Union[str, Sequence[int]]

# prompt + max_tokens at most, for a checkpoint whose config.json states no context length: beyond
# every supported family's trained context, and the (B, W) canvas it sizes stays small.
UNSTATED_CONTEXT = 1 << 20


@dataclass
class DiffusionResponse:
    """One committed block of one prompt, with running statistics."""

    text: str  # new text since the previous response
    tokens: List[int]  # new token ids since the previous response
    finish_reason: Optional[str]  # None while generating, then "stop" (EOS) or "length"
    prompt_tokens: int
    generation_tokens: int  # tokens generated so far
    nfe: int  # model forwards so far
    tokens_per_forward: float
    prompt_tps: float
    generation_tps: float
    peak_memory: float  # GB


@dataclass
class BatchResponse:
    texts: List[str]
    tokens: List[List[int]]
    finish_reasons: List[str]
    nfe: int
    tokens_per_forward: float
    generation_tps: float
    peak_memory: float


# ------------------------------------------------------------------------------------ settings


def checkpoint_settings(model, spec):
    """The settings a checkpoint's generation_config.json sets for this family."""
    gen = getattr(model, "generation_config", None) or {}
    keys = dict(GENERATION_CONFIG_KEYS)
    for key in spec.ignored_generation_config_keys:
        keys.pop(key, None)
    keys.update(spec.generation_config_keys)
    found = {}
    for key, setting in keys.items():
        value = gen
        for part in key.split("."):  # "a.b" reads a nested entry (sampler_config.entropy_bound)
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            found[setting] = value
    # What the checkpoint's own remote code implies (loader.remote_generate_params), under what
    # its generation_config.json says.
    params = getattr(model, "remote_generate_params", None) or ()
    for param, implied in spec.remote_generate_settings.items():
        if param in params:
            found = {**implied, **found}
    return found


def _eos_ids(model, tokenizer, spec):
    ids = set(spec.eos_token_ids)
    ids.update(getattr(tokenizer, "eos_token_ids", None) or ())
    gen = getattr(model, "generation_config", None) or {}
    eos = gen.get("eos_token_id")
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    ids.discard(None)
    return ids


def _add_bos(tokenizer, prompt: str) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return bos is None or not prompt.startswith(bos)


def _token_ids(prompt) -> List[int]:
    """A prompt given as token ids, checked: a sequence of ints (a numpy / mlx integer array too);
    bytes, booleans and floats are refused rather than read as ids or truncated."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise SettingsError(
            f"the prompt is {type(prompt).__name__}: give text (str, e.g. decode it first) or a "
            "list of token ids"
        )
    if hasattr(prompt, "tolist"):  # numpy / mlx arrays: their elements as Python scalars
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise SettingsError(
            f"a prompt is text (str) or a list of token ids, got {type(prompt).__name__}"
        )
    for t in prompt:
        if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)):
            raise SettingsError(
                f"prompt token ids must be integers, got {t!r} ({type(t).__name__}); a batch of "
                "prompts goes to batch_generate_diffusion"
            )
    return [int(t) for t in prompt]


def _encode(tokenizer, prompt: Prompt) -> List[int]:
    tokenizer = text_tokenizer(tokenizer)
    if isinstance(prompt, str) and prompt == "":
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would raise TypeError
            raise SettingsError(
                f"the prompt is not valid Unicode text ({e.reason}: {prompt[e.start : e.end]!r} at "
                f"position {e.start}); decode the source bytes with errors='replace'"
            ) from None
        ids = tokenizer.encode(prompt, add_special_tokens=_add_bos(tokenizer, prompt))
    else:
        ids = _token_ids(prompt)
    if len(ids) == 0:
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    return ids


def _prepare(model, tokenizer, prompts, settings, images=None):
    try:
        spec = getattr(model, "diffusion_spec", None)
    except CheckpointError:
        raise
    except ValueError as e:  # the spec is built from config.json on first use (e.g. no mask id)
        raise CheckpointError(str(e)) from None
    if spec is None:
        raise TypeError(
            f"{type(model).__module__}.{type(model).__name__} is not a diffusion model of this "
            "package (it has no diffusion_spec); load it with mlx_dllm_models.load"
        )
    s = resolve_settings(spec, settings, checkpoint_settings(model, spec))
    pixel_values = None
    if images is not None and not isinstance(images, (list, tuple)):
        raise SettingsError(
            "images must be a list with one entry per prompt (None, an image, or a list of "
            f"images), not a {type(images).__name__}"
        )
    if images is not None and any(i is not None for i in images):
        ids, pixel_values = _encode_with_images(model, tokenizer, prompts, images)
    else:
        ids = [_encode(tokenizer, p) for p in prompts]
    limit = spec.max_position_embeddings
    longest = max(len(p) for p in ids)
    if limit is not None and longest + s["max_tokens"] > limit:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s['max_tokens']}) exceeds the model's context "
            f"of {limit} positions; shorten the prompt or lower max_tokens"
        )
    if limit is None and longest + s["max_tokens"] > UNSTATED_CONTEXT:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s['max_tokens']}) exceeds {UNSTATED_CONTEXT} "
            "positions, this package's bound for a checkpoint whose config.json states no context "
            "length (max_position_embeddings); lower max_tokens, or add the field to config.json"
        )
    # A block (a canvas) is decoded whole even past max_tokens (block-causal layouts round up to
    # it, a canvas has a least length): one larger than the context would only allocate.
    for name in ("block_length", "min_canvas_length"):
        size, bound = s.get(name), limit or UNSTATED_CONTEXT
        if size is not None and size > bound:
            raise SettingsError(
                f"{name} ({size}) exceeds the model's context of {bound} positions; lower it"
            )
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
    if vocab is not None:
        bad = [t for p in ids for t in p if not 0 <= t < vocab]
        if bad:
            raise SettingsError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
    return spec, s, ids, pixel_values


def _encode_with_images(model, processor, prompts, images):
    """Token ids of every row and the pixel values of each (None for a row without images):
    `images` holds one entry per prompt, None or one image or a list of images."""
    if len(images) != len(prompts):
        raise SettingsError(
            f"images has {len(images)} entries for {len(prompts)} prompts; give one per prompt "
            "(None for a prompt without images)"
        )
    if getattr(model, "vision_tower", None) is None:
        raise SettingsError(
            "this checkpoint has no vision tower (its config.json has no vision_config), so it "
            "cannot read images; drop image= or use a multimodal checkpoint"
        )
    if not is_processor(processor):
        raise SettingsError(
            "images need the processor that mlx_dllm_models.load returns for this checkpoint, "
            f"not a {type(processor).__name__}"
        )
    ids, pixel_values = [], []
    for row, (prompt, row_images) in enumerate(zip(prompts, images)):
        if row_images is None:
            ids.append(_encode(processor, prompt))
            pixel_values.append(None)
            continue
        if not isinstance(prompt, str):
            raise SettingsError(
                f"prompt {row} has images, so it must be text (the processor places the image "
                "tokens), not a list of token ids"
            )
        if prompt == "":
            raise SettingsError(
                "the prompt is empty: give at least one token of text to condition on"
            )
        if not isinstance(row_images, (list, tuple)):
            row_images = [row_images]
        row_ids, row_pixels = encode_prompt(
            processor, prompt, row_images, _add_bos(processor.tokenizer, prompt)
        )
        ids.append(row_ids)
        pixel_values.append(row_pixels)
    return ids, pixel_values


# ------------------------------------------------------------------------------------- generate


class _Detokenizer:
    """Incremental text of a growing token list; holds back an incomplete UTF-8 tail."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: List[int] = []
        self.emitted = ""

    def add(self, tokens):
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens).rstrip("\ufffd")
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return new

    def flush(self):
        text = self.tokenizer.decode(self.tokens)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new


def _suffix_ids(tokenizer, suffix) -> List[int]:
    """The infilling suffix as token ids: text (encoded without BOS, it continues the canvas) or
    ids; empty means no suffix."""
    if suffix is None:
        return []
    if isinstance(suffix, str):
        return list(text_tokenizer(tokenizer).encode(suffix, add_special_tokens=False))
    return _token_ids(suffix)


def _check_infill(model, spec, s, ids, suffix):
    """Infilling (a suffix, or mask tokens inside a prompt) needs attention that sees every
    position: LLaDA, LLaDA-MoE and Dream. Refused clearly elsewhere, where masks would otherwise
    stay in the output or a suffix be ignored."""
    mask_id = spec.mask_token_id
    with_masks = [i for i, p in enumerate(ids) if mask_id is not None and mask_id in p]
    if not suffix and not with_masks:
        return
    what = "suffix=" if suffix else f"the mask token ({mask_id}) inside prompt {with_masks[0]}"
    if spec.attention != BIDIRECTIONAL or spec.decoder != "masked":
        raise SettingsError(
            f"infilling ({what}) needs bidirectional attention (LLaDA, LLaDA-MoE, Dream); the "
            f"{spec.family} family's {spec.attention} attention cannot see a suffix. Drop "
            f"{'suffix=' if suffix else 'the mask tokens from the prompt'}"
        )
    if mask_id in suffix:
        raise SettingsError(
            f"the suffix holds the mask token ({mask_id}); masks to fill go in the prompt, or "
            "between prompt and suffix through max_tokens"
        )
    if spec.logit_shift:
        first = [i for i in with_masks if ids[i][0] == mask_id]
        if first:
            raise SettingsError(
                f"prompt {first[0]} starts with the mask token: the {spec.family} family predicts "
                "a position from the one before it, so the first position cannot be filled; "
                "start the prompt with a real token"
            )
    limit = spec.max_position_embeddings
    longest = max(len(p) for p in ids)
    if limit is not None and longest + s["max_tokens"] + len(suffix) > limit:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s['max_tokens']}) + suffix ({len(suffix)} "
            f"tokens) exceeds the model's context of {limit} positions; shorten them"
        )
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
    bad = [t for t in suffix if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise SettingsError(f"suffix token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def _eot_id(tokenizer, spec, s) -> Optional[int]:
    """The end-of-turn id that LLaDA's confidence_eos_eot_inf scores 0 (generate.py's 126348,
    <|eot_id|>), from the checkpoint's tokenizer; and a check that logits_eos_inf has an EOS."""
    if s.get("logits_eos_inf") and not spec.eos_token_ids:
        raise SettingsError(
            "logits_eos_inf suppresses the checkpoint's EOS, but its config.json has no "
            "eos_token_id; add it or drop logits_eos_inf"
        )
    if not s.get("confidence_eos_eot_inf"):
        return None
    tok = text_tokenizer(tokenizer)
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    for name in spec.eot_token_names:
        if name in vocab:
            return int(vocab[name])
    raise SettingsError(
        "confidence_eos_eot_inf scores the end-of-turn token, but this checkpoint's tokenizer has "
        f"none of {', '.join(spec.eot_token_names) or 'the family’s end-of-turn tokens'}; drop "
        "confidence_eos_eot_inf"
    )


def stream_events(
    model, tokenizer, prompts: Sequence[Prompt], images=None, suffix=None, **settings
):
    """Low-level stream of engine events (StepEvent, BlockEvent) for a batch; used by the CLI's
    live view. `images`: None, or one entry per prompt: None (no image), an image (a path, PIL
    image or array) or a list of them, for text prompts, with the processor that `load` returns
    for a multimodal checkpoint. Returns (settings, prompt_ids, decoder);
    `decoder.run(prompt_ids)` yields the events. `suffix` (text or ids, infilling): every prompt
    is followed by max_tokens masks and then the suffix, and the masks are filled."""
    spec, s, ids, pixel_values = _prepare(model, tokenizer, prompts, settings, images)
    suffix_ids = _suffix_ids(tokenizer, suffix)
    _check_infill(model, spec, s, ids, suffix_ids)
    decoder = make_decoder(
        model,
        s,
        _eos_ids(model, tokenizer, spec),
        images=pixel_values,
        eot_token_id=_eot_id(tokenizer, spec, s),
        suffix=suffix_ids,
    )
    return s, ids, decoder


def stream_generate_diffusion(
    model, tokenizer, prompt: Prompt, image=None, suffix=None, **settings
) -> Iterator[DiffusionResponse]:
    """Yield a DiffusionResponse each time a block (a canvas) is committed, as it happens.
    `image`: a path, PIL image or array, or a list of them, with the processor of a multimodal
    checkpoint; a prompt without image placeholders gets the images first.

    Infilling (LLaDA, LLaDA-MoE, Dream): with `suffix` (text or ids), max_tokens masks go between
    the prompt and the suffix and are filled; mask tokens inside the prompt are filled too. The
    responses carry the filled span: from the prompt's first mask (when it holds masks, with the
    prompt's tokens after it) to the end of the max_tokens positions; never the suffix."""
    images = None if image is None else [image]
    s, ids, decoder = stream_events(
        model, tokenizer, [prompt], images=images, suffix=suffix, **settings
    )
    yield from responses(decoder, ids, tokenizer)


def responses(decoder, ids, tokenizer, on_step=None, prior=None) -> Iterator[DiffusionResponse]:
    """DiffusionResponses of a one-prompt decoder run; `on_step(StepEvent)` sees every denoising
    step (the CLI's live view draws from it); `prior` (a cache.PriorKV from the decoder's
    `kv_prefix` after an earlier run) lets the prefill reuse that run's K/V (chat.py)."""
    detok = _Detokenizer(tokenizer)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_time = None
    generated = 0
    events = decoder.run(ids) if prior is None else decoder.run(ids, prior=prior)
    for event in events:
        if prompt_time is None and decoder.nfe > 0:
            prompt_time = time.perf_counter() - tic
        if not isinstance(event, BlockEvent):
            if on_step is not None:
                on_step(event)
            continue
        toks = event.tokens[0]
        generated += len(toks)
        done = event.finished[0]
        text = detok.add(toks)
        if done:
            text += detok.flush()
        elapsed = time.perf_counter() - tic
        reason = None
        if done:
            reason = "stop" if event.eos[0] else "length"
        yield DiffusionResponse(
            text=text,
            tokens=toks,
            finish_reason=reason,
            prompt_tokens=len(ids[0]),
            generation_tokens=generated,
            nfe=decoder.nfe,
            tokens_per_forward=generated / max(decoder.nfe, 1),
            prompt_tps=len(ids[0]) / prompt_time if prompt_time else 0.0,
            generation_tps=generated / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
        )
        if done:
            return


def generate_diffusion(
    model,
    tokenizer,
    prompt: Prompt,
    *,
    max_tokens: Optional[int] = None,
    verbose: bool = False,
    image=None,
    **settings,
) -> str:
    """Generate a completion of `prompt` and return its text (`image`: see
    stream_generate_diffusion)."""
    text = ""
    last = None
    for last in stream_generate_diffusion(
        model, tokenizer, prompt, image=image, max_tokens=max_tokens, **settings
    ):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose and last is not None:
        print()
        print("=" * 10)
        print(stats_line(last))
    return text


def stats_line(r: DiffusionResponse) -> str:
    """mlx-lm's closing statistics line, with the diffusion statistics."""
    return (
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tokens-per-sec | "
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tokens-per-sec | "
        f"NFE: {r.nfe}, {r.tokens_per_forward:.2f} tokens/forward | "
        f"Peak memory: {r.peak_memory:.3f} GB"
    )


def batch_generate_diffusion(
    model, tokenizer, prompts: Sequence[Prompt], images=None, **settings
) -> BatchResponse:
    """Generate for several prompts at once (left-padded; each row stops at its own EOS and is
    dropped from the batch when it does). `images`: None, or one entry per prompt (None, an
    image, or a list of images; see stream_events): each row reads its own images, and at
    temperature 0 gets the tokens it would get alone."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, (list, tuple)):
        raise SettingsError(
            f"prompts must be a list of prompts (each text or a list of token ids), got "
            f"{type(prompts).__name__}; for one prompt pass [prompt] or use generate_diffusion"
        )
    if not prompts:
        raise SettingsError("prompts is empty: give at least one prompt")
    s, ids, decoder = stream_events(model, tokenizer, prompts, images=images, **settings)
    out = [[] for _ in ids]
    reasons = ["length"] * len(ids)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            for row, toks, hit in zip(event.rows, event.tokens, event.eos):
                out[row].extend(toks)
                if hit:
                    reasons[row] = "stop"
    elapsed = time.perf_counter() - tic
    total = sum(len(t) for t in out)
    return BatchResponse(
        texts=[tokenizer.decode(t) for t in out],
        tokens=out,
        finish_reasons=reasons,
        nfe=decoder.nfe,
        tokens_per_forward=total / max(decoder.nfe, 1),
        generation_tps=total / elapsed if elapsed > 0 else 0.0,
        peak_memory=mx.get_peak_memory() / 1e9,
    )
