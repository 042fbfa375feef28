"""What the model families share (mlx-lm's `base.py` role): the protocol's forward over a body's
layers, the checkpoint checks run by `sanitize`, the special-token ids read from config.json, and
the cached `diffusion_spec`."""

from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..spec import BLOCK_CAUSAL, DiffusionSpec

# -------------------------------------------------------------------------------------- forward


def run_layers(layers, h: mx.array, cache, mask, *layer_args) -> mx.array:
    """Every layer under the caller's mask (the protocol's None, "causal" or an array).
    `layer_args` go between the hidden states and the mask (ministral3 takes its query scale
    there)."""
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(h.dtype)  # SDPA wants an additive mask in the activation dtype
    if cache is None:
        cache = [None] * len(layers)
    for layer, c in zip(layers, cache):
        h = layer(h, *layer_args, mask, c)
    return h


def select_span(h: mx.array, head_span) -> mx.array:
    if head_span is None:
        return h
    if isinstance(head_span, slice):
        return h[:, head_span]
    return h[:, head_span[0] : head_span[1]]


def project(h: mx.array, head_span, norm, embed, head=None) -> mx.array:
    """Final norm and LM head over the positions of `head_span` only: at large vocabularies the
    head is the most expensive matmul. `head` None means the head is tied to `embed`."""
    h = norm(select_span(h, head_span))
    return embed.as_linear(h) if head is None else head(h)


def masked_forward(model, embed, inputs, cache, mask, head_span, input_embeddings=None) -> mx.array:
    """The protocol's forward of a body laid out as mlx-lm's (`model.model.norm`, `model.lm_head`
    unless `args.tie_word_embeddings`): its layers under the caller's mask, then `project`.
    `input_embeddings` (B, L, H), when given, enter the layers in place of `embed(inputs)`."""
    h = embed(inputs) if input_embeddings is None else input_embeddings
    h = run_layers(model.layers, h, cache, mask)
    head = None if model.args.tie_word_embeddings else model.lm_head
    return project(h, head_span, model.model.norm, embed, head)


# ----------------------------------------------------------------------- mlx-lm's AR tools


class NotAutoregressiveError(ValueError):
    pass


def refuse_autoregressive_tools(model):
    """`Model.make_cache` of the masked-diffusion families (assign it in the class body).

    mlx-lm's generate, chat, server, evaluate and cache_prompt all start with
    `mlx_lm.models.cache.make_prompt_cache(model)`, which asks `model.make_cache()` first; they would
    otherwise decode a masked-diffusion model token by token and print nonsense (an empty answer on
    the embedded default). This package's engine builds its own caches (cache.py) and never calls
    it, so refusing here stops exactly mlx-lm's autoregressive path, before any forward pass."""
    raise NotAutoregressiveError(
        f"{model.args.model_type} is a masked-diffusion model, not an autoregressive one: "
        "mlx-lm's generate, chat, server, evaluate and cache_prompt cannot decode it. Use this "
        "package's commands instead: `mlx_dllm generate --model PATH --prompt TEXT` (also "
        "`mlx_dllm evaluate`, `mlx_dllm lora`), or from Python `mlx_dllm_models.load` and "
        "`generate_diffusion`."
    )


def unquantized_vision(*prefixes: str) -> property:
    """A vision family's `quant_predicate` (the property mlx-lm's convert reads): the weights under
    `prefixes` (its vision path) stay unquantized, as mlx-vlm keeps vision towers."""

    def predicate(path, module):
        return not path.startswith(prefixes)

    return property(lambda model: predicate)


class ImageTextModel:
    """What a vision family's Model (a text body and a vision tower on mlx's Module) shares: mlx-lm's
    AR tools refused at make_cache, and its text layers where mlx-lm's tools and the engine's
    caches look for them."""

    make_cache = refuse_autoregressive_tools

    def __init__(self, args):
        # The next class in the Model's bases is mlx's Module.
        super().__init__()
        self.args = args
        self.config = args  # mlx-vlm's name for it
        self.model_type = args.model_type

    @property
    def layers(self):
        return self.model.layers


class ImageTokenizer(nn.Module):
    """What the image VQ tokenizers (MAGVIT-v2, diffusers' VQModel) show the image decoders: their
    config's codebook size and downsampling factor."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    @property
    def downsample(self) -> int:
        return self.config.downsample


# ----------------------------------------------------------------------------------- checkpoint

# Suffixes of tensors that quantized layers add next to their `.weight`.
QUANT_SUFFIXES = ("scales", "biases", "global_scale")


def drop_unused_buffers(weights: dict) -> dict:
    # Some exports carry RoPE's non-persistent buffer; it is recomputed here.
    return {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}


def drop_tied_head(weights: dict, family: str, tied: bool, head: str = "lm_head.weight") -> dict:
    if tied:
        # A tied checkpoint may still carry the head's copy; the embedding is the head.
        weights.pop(head, None)
    elif weights and head not in weights:
        raise ValueError(
            f"{family}: config.json has tie_word_embeddings=false but the checkpoint has no "
            f"{head}; set tie_word_embeddings to true if the head shares the embedding."
        )
    return weights


def sanitize_experts(parent_sanitize, weights, family: str, num_experts: int) -> dict:
    """mlx-lm's sanitize of an MoE body (stacks per-expert weights), with a readable error for a
    checkpoint that has fewer experts than its config says."""
    try:
        return parent_sanitize(drop_unused_buffers(weights))
    except KeyError as e:
        raise ValueError(
            f"{family}: expert weight {e} is missing; config.json says num_experts="
            f"{num_experts}, the checkpoint has fewer."
        ) from None


def _examples(names: Sequence[str], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{list(names[:most])}{more}"


def check_weights(
    model,
    weights: dict,
    family: str,
    layout: str,
    config_keys: str,
    origin: Optional[Mapping[str, str]] = None,
) -> dict:
    """Sanitized `weights` against the parameters of the model config.json describes: unknown
    names, missing names and wrong shapes raise a ValueError that names the family, gives examples
    and says what to check, instead of mlx's generic load error.

    `layout` describes the checkpoint names the family reads, `config_keys` the config.json fields
    that decide which weights exist and their shapes. `origin` maps a sanitized name back to the
    checkpoint's own, for the messages. Quantized layers' `scales` / `biases` / `global_scale` sit
    next to a known `.weight`; their packed uint32 weights have another shape by design."""
    expected = dict(tree_flatten(model.parameters()))
    origin = origin or {}

    def known(key):
        module, _, leaf = key.rpartition(".")
        return key in expected or (leaf in QUANT_SUFFIXES and f"{module}.weight" in expected)

    unknown = sorted(origin.get(k, k) for k in weights if not known(k))
    if unknown:
        raise ValueError(
            f"{family}: unexpected weights {_examples(unknown)}: they do not belong to this "
            f"architecture, which reads {layout}. Check that config.json's model_type matches "
            f"the checkpoint and that its {config_keys} agree with the weights."
        )
    # mlx-lm's sharded_load first builds the model from config.json alone and sanitizes no weights.
    missing = sorted(k for k in expected if k not in weights) if weights else []
    if missing:
        raise ValueError(
            f"{family}: missing weights {_examples(missing)}: the model config.json describes has "
            f"them, the checkpoint does not. Check that config.json belongs to these weights (its "
            f"{config_keys})."
        )
    quantized = {k.rpartition(".")[0] for k in weights if k.endswith(".scales")}
    for key, value in weights.items():
        want = expected.get(key)
        if want is None or value.dtype == mx.uint32 or key.rpartition(".")[0] in quantized:
            continue
        if value.shape != want.shape:
            raise ValueError(
                f"{family}: weight {origin.get(key, key)!r} has shape {tuple(value.shape)} but "
                f"config.json implies {tuple(want.shape)}; check its {config_keys}."
            )
    return weights


# ---------------------------------------------------------------------------- special token ids

TokenIds = Union[int, Sequence[int], None]


def eos_token_ids(value: TokenIds) -> Tuple[int, ...]:
    """config.json's eos_token_id (an int, a list or null) as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def check_token_id(
    family: str,
    key: str,
    value: Any,
    vocab_size: int,
    *,
    absent: Iterable[Any] = (None,),
    default: Optional[int] = None,
    vocab_key: str = "vocab_size",
) -> Optional[int]:
    """config.json's `key` as an int, or None when it is one of `absent` (what the family reads as
    "no such token"); `default` (the family's id) when config.json does not set it.

    Any other id outside [0, vocab_size) is a ValueError here, when the checkpoint loads: used as a
    token, it indexes past the embedding table or the logits, which Metal answers with a crash or
    garbage rather than an exception."""
    absent = tuple(absent)
    from_default = value is None and default is not None
    if from_default:
        value = default
    if value in absent:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{family}: config.json's {key} must be an integer token id, got {value!r}."
        )
    if 0 <= value < vocab_size:
        return value
    if from_default:
        source = f"config.json does not set {key}, and {value} is the family's default"
    elif key.endswith("eos_token_id"):
        # mlx-lm's load_config copies generation_config.json's eos_token_id over config.json's.
        source = f"it comes from {key} in generation_config.json or config.json"
    else:
        source = f"it comes from {key} in config.json"
    none = " / ".join("null" if a is None else str(a) for a in absent)
    none = f" or to {none} if it has none" if none else ""
    raise ValueError(
        f"{family}: {key} {value} is outside the vocabulary ({vocab_key} {vocab_size}: token ids "
        f"run from 0 to {vocab_size - 1}); {source}. Set {key} to the id the checkpoint's "
        f"tokenizer gives that token (see tokenizer.json's added_tokens){none}, or correct "
        f"{vocab_key} if that is what is wrong."
    )


def check_token_ids(
    family: str, vocab_size: int, ids: Mapping[str, TokenIds], vocab_key: str = "vocab_size"
) -> None:
    """`check_token_id` over a config's special ids (config.json key -> value; an EOS key may
    hold a list). pad and bos ids may also be -1, which some configs write for "none" (no decoding
    path here reads them)."""
    for key, value in ids.items():
        absent = (None, -1) if key.endswith(("pad_token_id", "bos_token_id")) else (None,)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            check_token_id(family, key, v, vocab_size, absent=absent, vocab_key=vocab_key)


def check_special_ids(
    args,
    keys: Sequence[str] = ("eos_token_id", "pad_token_id", "bos_token_id"),
    mask_default: Optional[int] = None,
    mask_absent: Iterable[Any] = (),
) -> None:
    """Resolve `args.mask_token_id` (the family's `mask_default` when config.json omits it; None
    when it is one of `mask_absent`) and check it and the config's other special ids (`keys`)
    against `args.vocab_size`."""
    args.mask_token_id = check_token_id(
        args.model_type,
        "mask_token_id",
        args.mask_token_id,
        args.vocab_size,
        absent=mask_absent,
        default=mask_default,
    )
    check_token_ids(args.model_type, args.vocab_size, {k: getattr(args, k) for k in keys})


# The config.json fields a Qwen2 / Qwen3 body's mlx-lm ModelArgs takes under the same names.
QWEN_BODY_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
)


def config_fields(args, names: Sequence[str]) -> dict:
    """{name: value} of `args`' fields `names`: the arguments of a body's ModelArgs that a
    family's config.json carries under the same names."""
    return {name: getattr(args, name) for name in names}


def check_context_length(family: str, key: str, value) -> None:
    """A context length from config.json is a positive integer or absent: 0 is not "no limit"."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(
        f"{family}: config.json's {key} (the context length) must be a positive integer, got "
        f"{value!r}; set it to the length the checkpoint was trained with, or remove the field"
    )


# ---------------------------------------------------------------------------------------- spec


def build_spec(
    args, family: str, attention: str, missing_mask: Optional[str] = None, **fields
) -> DiffusionSpec:
    """The family's DiffusionSpec, with what every masked family reads from config.json the same
    way: the mask id, the EOS ids and the context length (`fields` may override the latter).

    A config without a mask id may still load (Dream's generation_config has a null one; Nemotron
    serves as an AR model without one): `missing_mask` says what to do when decoding asks."""
    if args.mask_token_id is None and missing_mask is not None:
        raise ValueError(
            f"{args.model_type}: config.json has no mask_token_id, so the checkpoint cannot be "
            f"decoded by diffusion; {missing_mask}"
        )
    fields.setdefault("max_position_embeddings", args.max_position_embeddings)
    context = fields["max_position_embeddings"]
    check_context_length(args.model_type, "max_position_embeddings", context)
    return DiffusionSpec(
        family=family,
        attention=attention,
        mask_token_id=args.mask_token_id,
        eos_token_ids=eos_token_ids(args.eos_token_id),
        **fields,
    )


def own_loop_spec(
    args,
    family: str,
    attention: str,
    decoders: dict,
    settings,
    unused: dict,
    defaults: dict,
    **fields,
) -> DiffusionSpec:
    """The spec of a family decoded by the one loop it registers (`decoders`: its model file's
    DECODERS, that loop under its `decoder` name), with its setting rows, the shared settings that
    loop has no use for (`unused`), its defaults and config.json's vocabulary size."""
    (decoder,) = decoders
    return build_spec(
        args,
        family,
        attention,
        settings=settings,
        unused_settings=unused,
        decoder=decoder,
        decoders=decoders,
        defaults=dict(defaults),
        vocab_size=args.vocab_size,
        **fields,
    )


# How the block-causal references (SDAR's and Fast-dLLM v2's generate) read a step: the sampled
# token's probability is its confidence, quotas count over the block, and a threshold keeps the
# tokens strictly above it (x1_p > threshold).
BLOCK_READING = dict(confidence="sampled", quota_base="block", strict_threshold=True)


def trained_blocks_spec(args, family: str, block: int, defaults: dict, **fields) -> DiffusionSpec:
    """The spec of a block-causal family trained on blocks of `block` positions, its default
    block_length, whose reference generate reads a step as BLOCK_READING says, samples with
    temperature, then top-k, then top-p, and takes them as its own arguments (a
    generation_config.json's AR sampling values are never read): SDAR's and Fast-dLLM v2's."""
    return build_spec(
        args,
        family,
        BLOCK_CAUSAL,
        **BLOCK_READING,
        sampling_order=("temperature", "top_k", "top_p"),
        ignored_generation_config_keys=("temperature", "top_k", "top_p"),
        defaults={"block_length": block, **defaults},
        trained_block_length=block,
        **fields,
    )


class cached_spec:
    """Decorates `Model.diffusion_spec`: the spec is built from `model.args` on first use and kept,
    so that the engine, the settings and the tests read one object. Assigning a spec replaces it
    (tests swap one field with `dataclasses.replace`); reassigning a field of `model.args` builds
    it again. Kept in the instance `__dict__`, outside nn.Module's parameter tree."""

    def __init__(self, build):
        self.build = build
        self.__doc__ = build.__doc__

    def __set_name__(self, owner, name):
        self.key = f"_{name}"

    def __get__(self, model, owner=None):
        if model is None:
            return self
        config = vars(model.args)
        kept = model.__dict__.get(self.key)
        if kept is None or (kept[0] is not None and kept[0] != config):
            kept = (dict(config), self.build(model))
            model.__dict__[self.key] = kept
        return kept[1]

    def __set__(self, model, spec):
        model.__dict__[self.key] = (None, spec)
