"""Public API: generate_diffusion, stream_generate_diffusion, batch_generate_diffusion (and load,
from loader.py).

Mirrors mlx-lm's generate / stream_generate: a prompt is text (tokenized as mlx-lm does, no chat
template) or a list of token ids; generation stops at an EOS, which is not returned
(finish_reason "stop"), else at max_tokens (finish_reason "length").
"""

import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .engine import BlockEvent, make_decoder
from .settings import GENERATION_CONFIG_KEYS, SettingsError, resolve_settings
from .vision import encode_prompt, is_processor, text_tokenizer

Prompt = Union[str, Sequence[int]]


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


def _encode(tokenizer, prompt: Prompt) -> List[int]:
    tokenizer = text_tokenizer(tokenizer)
    if isinstance(prompt, str) and prompt == "":
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=_add_bos(tokenizer, prompt))
    else:
        ids = [int(t) for t in prompt]
    if len(ids) == 0:
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    return ids


def _prepare(model, tokenizer, prompts, settings, images=None):
    spec = getattr(model, "diffusion_spec", None)
    if spec is None:
        raise TypeError(
            f"{type(model).__module__}.{type(model).__name__} is not a diffusion model of this "
            "package (it has no diffusion_spec); load it with mlx_dllm_models.load"
        )
    s = resolve_settings(spec, settings, checkpoint_settings(model, spec))
    pixel_values = None
    if images is not None:
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
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
    if vocab is not None:
        bad = [t for p in ids for t in p if not 0 <= t < vocab]
        if bad:
            raise SettingsError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
    return spec, s, ids, pixel_values


def _encode_with_images(model, processor, prompts, images):
    if not isinstance(images, (list, tuple)):
        images = [images]
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
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise SettingsError(
            "images go with a single text prompt (the processor places the image tokens); "
            "generate one prompt at a time"
        )
    prompt = prompts[0]
    if prompt == "":
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    ids, pixel_values = encode_prompt(
        processor, prompt, images, _add_bos(processor.tokenizer, prompt)
    )
    return [ids], pixel_values


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


def stream_events(model, tokenizer, prompts: Sequence[Prompt], images=None, **settings):
    """Low-level stream of engine events (StepEvent, BlockEvent) for a batch; used by the CLI's
    live view. `images` (paths, PIL images or arrays) go with a single text prompt and need the
    processor that `load` returns for a multimodal checkpoint. Returns (settings, prompt_ids,
    decoder); `decoder.run(prompt_ids)` yields the events."""
    spec, s, ids, pixel_values = _prepare(model, tokenizer, prompts, settings, images)
    decoder = make_decoder(model, s, _eos_ids(model, tokenizer, spec), images=pixel_values)
    return s, ids, decoder


def stream_generate_diffusion(
    model, tokenizer, prompt: Prompt, image=None, **settings
) -> Iterator[DiffusionResponse]:
    """Yield a DiffusionResponse each time a block (a canvas) is committed, as it happens.
    `image`: a path, PIL image or array, or a list of them, with the processor of a multimodal
    checkpoint; a prompt without image placeholders gets the images first."""
    s, ids, decoder = stream_events(model, tokenizer, [prompt], images=image, **settings)
    yield from responses(decoder, ids, tokenizer)


def responses(decoder, ids, tokenizer, on_step=None) -> Iterator[DiffusionResponse]:
    """DiffusionResponses of a one-prompt decoder run; `on_step(StepEvent)` sees every denoising
    step (the CLI's live view draws from it)."""
    detok = _Detokenizer(tokenizer)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_time = None
    generated = 0
    for event in decoder.run(ids):
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
    model, tokenizer, prompts: Sequence[Prompt], **settings
) -> BatchResponse:
    """Generate for several prompts at once (left-padded; each row stops at its own EOS and is
    dropped from the batch when it does)."""
    if not prompts:
        raise SettingsError("prompts is empty: give at least one prompt")
    s, ids, decoder = stream_events(model, tokenizer, prompts, **settings)
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
