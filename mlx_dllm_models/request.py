"""The request layer: a prompt and its settings made ready for a decoder, once.

`prepare(model, tokenizer, prompts, settings, images=, suffix=)` resolves the settings (explicit,
then the checkpoint's generation_config.json, then the family's spec, then the package defaults),
encodes the prompts (text as mlx-lm tokenizes it, or token ids; images through the processor),
checks them against the model (context, vocabulary, infilling) and returns a `Request`: the
effective spec (the family's with what its sampler brings, spec.for_settings, computed here once),
the resolved settings, the ids, the pixel values, the EOS ids, the end-of-turn id and the infilling
suffix. A Request is the engine's DecoderInputs with its prompts: `Request.decoder(model)` builds
the decoding loop from it (engine.build_decoder). generate, the server, likelihood and chat all go
through here; `Detokenizer` turns committed tokens into text as they arrive.
"""

import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

from .engine.contracts import Decoder, DecoderInputs
from .engine.registry import build_decoder, check_constraints
from .errors import CheckpointError
from .settings import SettingsError, resolve_settings
from .settings_fields import ResolvedSettings
from .spec import (
    BIDIRECTIONAL,
    GENERATION_CONFIG_KEYS,
    for_settings,
    read_generation_config,
)
from .structured import CONSTRAINT_KEYS, compile_rows
from .vision import encode_prompt, is_processor, model_processor, text_tokenizer

Prompt = Union[str, Sequence[int]]

# prompt + max_tokens at most, for a checkpoint whose config.json states no context length: beyond
# every supported family's trained context, and the (B, W) canvas it sizes stays small.
UNSTATED_CONTEXT = 1 << 20


@dataclass
class Request(DecoderInputs):
    """Prompts ready to decode: what every caller of a decoder needs, resolved once (the
    decoder's inputs, engine.contracts.DecoderInputs, and the prompts' ids)."""

    ids: List[List[int]] = field(default_factory=list)  # one row per prompt
    # Positions of the caller's max_tokens that the family's default suffix takes (RND1's pad):
    # settings.max_tokens counts the canvas's masks, this many fewer.
    reserved: int = 0

    def decoder(self, model) -> Decoder:
        """The decoding loop of this request (engine.build_decoder); `decoder.run(self.ids)`
        yields its events."""
        return build_decoder(model, self)


def prepare(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    settings: dict,
    images=None,
    suffix=None,
    fit_context: bool = False,
) -> Request:
    """The Request of a batch of prompts: settings resolved and every input checked (a
    SettingsError or CheckpointError says what is wrong). `images`: None, or one entry per prompt:
    None, an image (a path, PIL image or array) or a list of them, for text prompts, with the
    processor that `load` returns for a multimodal checkpoint. `suffix` (text or ids,
    infilling): every prompt is followed by max_tokens masks and then the suffix; None: the
    family's default suffix (spec.default_suffix: RND1's trailing pad), if it has one, which
    takes its positions from max_tokens (the resolved max_tokens is the masks before it).
    `fit_context`: a max_tokens past the model's context is lowered to what fits after the
    longest prompt (the server's rule, as mlx_lm.server's), instead of refused; a prompt that
    fills the context alone is still refused.

    Structured output: `json_schema`, `regex` or `lark` among the settings (one value for every
    prompt, or a list with one entry per prompt, None for an unconstrained one) constrain the
    generated text (structured.py); they are compiled here and never enter the settings."""
    overrides = dict(settings)
    # A vision model of ours with the bare tokenizer mlx_vlm.load found: its own processor.
    tokenizer = model_processor(model, tokenizer)
    wanted = {k: overrides.pop(k) for k in CONSTRAINT_KEYS if overrides.get(k) is not None}
    for k in CONSTRAINT_KEYS:
        overrides.pop(k, None)
    spec, s, ids, pixel_values = _prepare_rows(
        model, tokenizer, prompts, overrides, images, fit_context, default_suffix=suffix is None
    )
    # What the run decodes under, once: a sampler may bring its layout (dllm's bd3lm).
    spec = for_settings(spec, s)
    # No suffix given: the one the family's reference always places (RND1's trailing pad).
    reserved = len(spec.default_suffix) if suffix is None else 0
    suffix = list(spec.default_suffix) if suffix is None else suffix_ids(tokenizer, suffix)
    check_infill(model, spec, s, ids, suffix)
    eos = eos_ids(model, tokenizer, spec)
    constraints = None
    if wanted:
        check_constraints(spec, s)  # a decoder without them refuses before anything compiles
        if spec.mask_token_id is not None and any(spec.mask_token_id in p for p in ids):
            raise SettingsError(
                "a constraint (json_schema / regex / lark) applies to the text after the "
                "prompt; mask tokens inside a prompt are not supported with it: drop them (a "
                "suffix is)"
            )
        vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
        constraints = compile_rows(wanted, len(ids), text_tokenizer(tokenizer), vocab, eos)
    return Request(
        spec=spec,
        settings=s,
        ids=ids,
        pixel_values=pixel_values,
        eos_token_ids=eos,
        eot_token_id=eot_id(tokenizer, spec, s),
        suffix=suffix,
        constraints=constraints,
        reserved=reserved,
    )


def checkpoint_settings(model, spec):
    """The settings a checkpoint's generation_config.json sets for this family."""
    gen = getattr(model, "generation_config", None) or {}
    keys = dict(GENERATION_CONFIG_KEYS)
    for key in spec.ignored_generation_config_keys:
        keys.pop(key, None)
    keys.update(spec.generation_config_keys)
    found = read_generation_config(gen, keys)
    # What the checkpoint's own remote code implies (loader.remote_generate_params), under what
    # its generation_config.json says.
    params = getattr(model, "remote_generate_params", None) or ()
    for param, implied in spec.remote_generate_settings.items():
        if param in params:
            found = {**implied, **found}
    return found


def eos_ids(model, tokenizer, spec):
    ids = set(spec.eos_token_ids)
    ids.update(getattr(tokenizer, "eos_token_ids", None) or ())
    if spec.eos_token_names and tokenizer is not None:
        vocab = text_tokenizer(tokenizer).get_vocab()
        ids.update(int(vocab[n]) for n in spec.eos_token_names if n in vocab)
    gen = getattr(model, "generation_config", None) or {}
    eos = gen.get("eos_token_id")
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    ids.discard(None)
    return ids


def add_bos(tokenizer, prompt: str) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return bos is None or not prompt.startswith(bos)


def token_ids(prompt) -> List[int]:
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


def encode(
    tokenizer, prompt: Prompt, prefix: Sequence[int] = (), drop_eos: Sequence[int] = ()
) -> List[int]:
    """A prompt's ids; `prefix` (spec.prompt_prefix) goes first unless they already start with it,
    and makes an empty prompt valid (the prefix alone); a text prompt's last id, when in
    `drop_eos` (the EOS ids of a spec with prompt_drops_eos), is dropped."""
    if isinstance(prompt, str):
        empty = prompt == ""
    else:  # token ids (anything else is _encode's error)
        empty = isinstance(prompt, (list, tuple, range)) or hasattr(prompt, "tolist")
        empty = empty and len(prompt) == 0
    if prefix and empty:
        return list(prefix)
    ids = _encode(tokenizer, prompt)
    if isinstance(prompt, str) and len(ids) > 1 and ids[-1] in drop_eos:
        ids = ids[:-1]
    prefix = list(prefix)
    return ids if ids[: len(prefix)] == prefix else prefix + ids


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
        ids = tokenizer.encode(prompt, add_special_tokens=add_bos(tokenizer, prompt))
    else:
        ids = token_ids(prompt)
    if len(ids) == 0:
        raise SettingsError("the prompt is empty: give at least one token of text to condition on")
    return ids


def _reserve_default_suffix(model, spec, overrides, max_tokens: int) -> ResolvedSettings:
    """The settings resolved again with max_tokens less the default suffix's positions (the
    canvas's masks), so that what follows from max_tokens (one block over the generation, the
    schedule's masks) follows them, as in RND1's generate(max_new_tokens=max_tokens)."""
    reserved = len(spec.default_suffix)
    if max_tokens <= reserved:
        raise SettingsError(
            f"max_tokens must be at least {reserved + 1} for the {spec.family} family: the last "
            f"{reserved} of its positions hold the pad token its reference always places there"
        )
    lowered = dict(overrides, max_tokens=max_tokens - reserved)
    return resolve_settings(spec, lowered, checkpoint_settings(model, spec))


def _prepare_rows(
    model, tokenizer, prompts, overrides, images=None, fit_context=False, default_suffix=False
):
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
    s = resolve_settings(spec, overrides, checkpoint_settings(model, spec))
    pixel_values = None
    if images is not None and not isinstance(images, (list, tuple)):
        raise SettingsError(
            "images must be a list with one entry per prompt (None, an image, or a list of "
            f"images), not a {type(images).__name__}"
        )
    if images is not None and any(i is not None for i in images):
        ids, pixel_values = encode_with_images(model, tokenizer, prompts, images)
    else:
        drop = spec.eos_token_ids if spec.prompt_drops_eos else ()
        ids = [encode(tokenizer, p, spec.prompt_prefix, drop) for p in prompts]
    limit = spec.max_position_embeddings
    longest = max(len(p) for p in ids)
    room = (limit or UNSTATED_CONTEXT) - longest
    if fit_context and s.max_tokens > room:
        if room < 1:
            raise SettingsError(
                f"the prompt ({longest} tokens) fills the model's context of "
                f"{limit or UNSTATED_CONTEXT} positions and leaves no room for a completion; "
                "shorten the prompt"
            )
        # Resolved again, so that what follows from max_tokens (a block over the whole
        # generation, its steps) follows the lowered value.
        overrides = dict(overrides, max_tokens=room)
        s = resolve_settings(spec, overrides, checkpoint_settings(model, spec))
    if limit is not None and longest + s.max_tokens > limit:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s.max_tokens}) exceeds the model's context "
            f"of {limit} positions; shorten the prompt or lower max_tokens"
        )
    if limit is None and longest + s.max_tokens > UNSTATED_CONTEXT:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s.max_tokens}) exceeds {UNSTATED_CONTEXT} "
            "positions, this package's bound for a checkpoint whose config.json states no context "
            "length (max_position_embeddings); lower max_tokens, or add the field to config.json"
        )
    if default_suffix and spec.default_suffix:
        s = _reserve_default_suffix(model, spec, overrides, s.max_tokens)
    # A block (a canvas) is decoded whole even past max_tokens (block-causal layouts round up to
    # it, a canvas has a least length): one larger than the context would only allocate.
    for name in ("block_length", "min_canvas_length"):
        size, bound = getattr(s, name), limit or UNSTATED_CONTEXT
        if size is not None and size > bound:
            raise SettingsError(
                f"{name} ({size}) exceeds the model's context of {bound} positions; lower it"
            )
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
    if vocab is not None:
        # The vision families' image feature ids lie past the vocabulary: those of stored images.
        is_image_id = getattr(model, "is_image_id", None)
        bad = [
            t
            for p in ids
            for t in p
            if not 0 <= t < vocab and not (is_image_id is not None and is_image_id(t))
        ]
        if bad:
            images = (
                "; ids past it stand only for the features of images given through the processor"
                " (image=...)"
                if is_image_id is not None
                else ""
            )
            raise SettingsError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1}){images}"
            )
    return spec, s, ids, pixel_values


def encode_with_images(model, processor, prompts, images):
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
    if not is_processor(processor) and hasattr(model, "load_processor"):
        # mlx_lm.load gives LLaDA-V's bare tokenizer: its processor is built on it here.
        processor = model.load_processor(processor)
    if not is_processor(processor):
        raise SettingsError(
            "images need the processor that mlx_dllm_models.load returns for this checkpoint, "
            f"not a {type(processor).__name__}"
        )
    ids, pixel_values = [], []
    for row, (prompt, row_images) in enumerate(zip(prompts, images)):
        if row_images is None:
            ids.append(encode(processor, prompt))
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
            processor, prompt, row_images, add_bos(processor.tokenizer, prompt)
        )
        ids.append(row_ids)
        pixel_values.append(row_pixels)
    if all(p is None for p in pixel_values):
        # LLaDA-V's processor puts the image features into the ids themselves
        # (models/llava_llada.py): nothing is left for the decoder to read.
        return ids, None
    return ids, pixel_values


class Detokenizer:
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


def suffix_ids(tokenizer, suffix) -> List[int]:
    """The infilling suffix as token ids: text (encoded without BOS, it continues the canvas) or
    ids; empty means no suffix."""
    if suffix is None:
        return []
    if isinstance(suffix, str):
        return list(text_tokenizer(tokenizer).encode(suffix, add_special_tokens=False))
    return token_ids(suffix)


def check_infill(model, spec, s, ids, suffix):
    """Infilling (a suffix, or mask tokens inside a prompt) needs attention that sees every
    position: LLaDA, LLaDA-MoE and Dream. Refused clearly elsewhere, where masks would otherwise
    stay in the output or a suffix be ignored. `spec`: the effective one (spec.for_settings)."""
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
    if limit is not None and longest + s.max_tokens + len(suffix) > limit:
        raise SettingsError(
            f"prompt ({longest} tokens) + max_tokens ({s.max_tokens}) + suffix ({len(suffix)} "
            f"tokens) exceeds the model's context of {limit} positions; shorten them"
        )
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or spec.vocab_size
    bad = [t for t in suffix if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise SettingsError(f"suffix token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")


def eot_id(tokenizer, spec, s) -> Optional[int]:
    """The end-of-turn id that LLaDA's confidence_eos_eot_inf scores 0 (generate.py's 126348,
    <|eot_id|>), from the checkpoint's tokenizer; and a check that logits_eos_inf has an EOS."""
    if s.logits_eos_inf and not spec.eos_token_ids:
        raise SettingsError(
            "logits_eos_inf suppresses the checkpoint's EOS, but its config.json has no "
            "eos_token_id; add it or drop logits_eos_inf"
        )
    if not s.confidence_eos_eot_inf:
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
