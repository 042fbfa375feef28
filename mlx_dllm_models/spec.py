"""What a model family declares to the decoding engine.

A family's decoding facts (noise, mask id, attention layout, logit shift, how confidence is read,
which samplers it can honour, its reference defaults) live in one `DiffusionSpec` that the model
exposes as `model.diffusion_spec`. The engine reads the spec; it never asks for a model_type. The
settings a family adds, those of the shared vocabulary it has no use for or reads in its own terms,
are its spec's too (declared in its model file; settings.SETTINGS collects every family's rows for
the CLI and the docs); which caches a layout offers is the backend table's
(engine.registry.BACKENDS).
"""

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Tuple

from .settings_families import Relation, Setting
from .settings_fields import ResolvedSettings

# Attention layouts (see ARCHITECTURE.md, "Caches, by attention layout").
BIDIRECTIONAL = "bidirectional"  # LLaDA 1.x, LLaDA-MoE, Dream
BLOCK_CAUSAL = "block_causal"  # SDAR, LLaDA2.x: blocks aligned on absolute positions 0, B, 2B, ...
CAUSAL_PREFIX = "causal_prefix"  # Nemotron-Labs-Diffusion: causal KV prefix + bidirectional block
ENCODER_CANVAS = "encoder_canvas"  # DiffusionGemma: causal encoder KV + bidirectional canvas
# WeDLM: causal attention over the committed tokens and a sliding window whose filled positions
# come before its masks (topological reordering), on an ordinary causal K/V cache.
CAUSAL_WINDOW = "causal_window"
# LaViDa's prefix-DLM: the prompt (image + text) attends to itself only, the answer to everything,
# so the prompt's K/V never change while the answer is denoised.
PREFIX_DLM = "prefix_dlm"
# GIDD: the clean prefix (prompt, finished blocks) attends to itself only, the noisy rest of the
# canvas to everything; the prefix's K/V are recomputed once per block.
CLEAN_PREFIX = "clean_prefix"

SHARED_SAMPLERS = ("quota", "threshold", "factor", "entropy")

# The ELBO estimates likelihood.log_likelihood reproduces (DiffusionSpec.likelihood): LLaDA's
# get_log_likelihood.py (a mask count drawn per sample) and Dream's eval.py (low-discrepancy
# timesteps, an EOS appended).
MASK_COUNT_ELBO = "masks"
TIMESTEP_ELBO = "timesteps"

# generation_config.json key -> setting, read for every family (read_generation_config): a family's
# spec may add keys (generation_config_keys) or leave some out (ignored_generation_config_keys).
GENERATION_CONFIG_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "block_length": "block_length",
    "threshold": "threshold",
}


@dataclass(frozen=True)
class DiffusionSpec:
    family: str
    attention: str
    mask_token_id: Optional[int]
    eos_token_ids: Tuple[int, ...] = ()
    # Ids never proposed, besides the mask (LLaDA2.2's edit-control tokens when editing is off).
    suppressed_token_ids: Tuple[int, ...] = ()
    # (DELETE, SPLIT) of a family with insert/delete editing (LLaDA2.2): with editing on they are
    # proposed, and consumed by engine.editing.LevenshteinEditing.
    edit_token_ids: Tuple[int, ...] = ()
    # Ids whose logits are -inf before any statistic, so their probability mass goes to the others
    # (LLaDA-V's generate_with_embeds: <|endoftext|>, <|startoftext|>, the header ids); the
    # masked decoder applies them as logits_eos_inf does the EOS.
    logit_suppressed_token_ids: Tuple[int, ...] = ()
    # 1 for Dream: the prediction for position i comes from hidden state i-1.
    logit_shift: int = 0
    # Block-causal families with logit_shift=1 whose block starts from the token the previous
    # block's last position predicts once that block is whole (Fast-dLLM v2: argmax, never
    # denoised); the backend places it when the block begins.
    seeds_block_start: bool = False
    # "raw": confidence is softmax of the unprocessed logits at the chosen token (LLaDA lineage,
    # whose Gumbel sample uses temperature but whose confidence does not); "sampled": the
    # probability under the temperature / top-k / top-p processed distribution (Dream, LLaDA2, SDAR).
    confidence: str = "raw"
    # Per-step quota schedule base: "masks" splits the block's mask count over the steps (LLaDA
    # get_num_transfer_tokens); "block" splits block_length (LLaDA2, SDAR).
    quota_base: str = "masks"
    # The threshold rule compares with > (LLaDA2) instead of >= (Fast-dLLM).
    strict_threshold: bool = False
    samplers: Tuple[str, ...] = SHARED_SAMPLERS
    # The commit rules of the samplers the family declares as its own (sampler name ->
    # decoding.rule.CommitRule; its model file's SAMPLERS, which the families reusing them import
    # from the owning model file); the shared ones are decoding.samplers.COMMIT_RULES'.
    commit_rules: Mapping[str, Any] = field(default_factory=dict)
    # The decoding loop: "masked" block decoding (engine.registry.DECODERS), or a family's own loop.
    decoder: str = "masked"
    # Loops the family registers under names of its own (name -> an engine.contracts.Decoder
    # subclass; its model file's DECODERS), looked up before engine.registry.DECODERS.
    decoders: Mapping[str, Any] = field(default_factory=dict)
    # Reference defaults of the family, their one home (the settings table's family rows hold
    # none); the checkpoint's config / generation_config override them.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # generation_config.json key -> setting name, read on top of GENERATION_CONFIG_KEYS.
    generation_config_keys: Mapping[str, str] = field(default_factory=dict)
    # Keys of the shared mapping that this family's reference decoder never reads (SDAR's
    # generation_config holds AR sampling defaults that its diffusion generate ignores).
    ignored_generation_config_keys: Tuple[str, ...] = ()
    # The block size the checkpoint was trained with, for block-causal families (warn when changed).
    trained_block_length: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    # The reference's order of logits processing before sampling (decoding.stats.token_stats):
    # Dream divides by the temperature first, then filters top-p, then top-k.
    sampling_order: Tuple[str, ...] = ("top_k", "top_p", "temperature")
    # Defaults that come with a sampler (sampler -> {setting: value}), over `defaults`, under the
    # checkpoint and explicit settings. block_length None means one block over max_tokens.
    sampler_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Vocabulary size, for decoders that draw token ids (uniform-noise canvases) and for token-id
    # settings (settings.Setting.token_id).
    vocab_size: Optional[int] = None
    # A row's block stops denoising once it holds an EOS with no mask before it (the positions
    # after it are never returned), as Nemotron-Labs-Diffusion's generate breaks its step loop.
    eos_ends_block: bool = False
    # Once a row's block holds an EOS, only the masks before it stay candidates (LLaDA-V's
    # generate_with_embeds sets the confidence at and after its stop position to -inf).
    eos_bounds_candidates: bool = False
    # Token ids after every row's canvas when the caller gives no suffix (request.prepare): RND1's
    # generate reserves the last of its max_new_tokens positions for the pad token, which the
    # model sees at every step. They take their positions from max_tokens (the canvas is
    # max_tokens minus their number of masks); an explicit suffix replaces them and leaves
    # max_tokens masks (infilling).
    default_suffix: Tuple[int, ...] = ()
    # d3LLM's entropy-threshold commit (sampler "d3llm"): LLaDA's form (get_transfer_index_entropy)
    # commits the step's lowest-entropy candidate whatever its entropy and keeps the others at
    # entropy <= threshold; Dream's (_sample_multi_block) commits entropy < threshold only.
    threshold_keeps_lowest: bool = False
    # Names of tokens that end a row's text besides the EOS ids, resolved through the checkpoint's
    # tokenizer where it has them (request.eos_ids): DiffuCoder's <|dlm_pad|>, the padding its
    # instruct models write after <|im_end|>, where its README cuts the answer.
    eos_token_names: Tuple[str, ...] = ()
    # Preset settings: setting name -> its value -> the settings it brings (LLaDA2's
    # editing_mode: quality / speed / off), applied over `defaults` and `sampler_defaults`.
    presets: Mapping[str, Mapping[Any, Mapping[str, Any]]] = field(default_factory=dict)
    # Parameter of the checkpoint's own remote-code `generate` -> the settings its presence
    # implies (LLaDA2.1's generate takes editing_threshold, 2.0's does not: the one file-level
    # difference between their checkpoints). Read by checkpoint_settings.
    remote_generate_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Names of the end-of-turn token in the family's tokenizers (LLaDA's confidence_eos_eot_inf);
    # the id is the checkpoint tokenizer's, never hard-coded.
    eot_token_names: Tuple[str, ...] = ()
    # Block-causal families whose blocks end at the prompt's end rather than start at position 0
    # (dllm's BD3LMSampler: each prompt is left-padded to whole blocks, blocks are counted on those
    # columns, so the prompt's first block holds its leading len % block_length tokens); the
    # last block holds only the positions max_tokens leaves, not a whole block of masks.
    blocks_end_at_prompt: bool = False
    # Block-causal families whose canvas ends at max_tokens: blocks stay on absolute positions, but
    # the last one holds only the positions max_tokens leaves (Stable-DiffCoder's generate_block
    # shortens its last block to the prompt's remainder), not a whole block of masks cut afterwards.
    last_block_at_max_tokens: bool = False
    # Spec fields a sampler brings (sampler -> {field: value}), where the checkpoint cannot tell
    # how it was trained: dllm's A2D conversions are one model_type whether MDLM- or BD3LM-trained,
    # and its BD3LM sampler reads them block-causally (for_settings applies them).
    sampler_spec: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Token ids every prompt starts with: request.prepare puts them before a prompt that does not
    # already begin with them, so an empty prompt is these alone (BD3-LM's _semi_ar_sampler
    # samples after the BOS at position 0: its unconditional generation).
    prompt_prefix: Tuple[int, ...] = ()
    # The tokenizer ends every encoding with the EOS, which the reference's call cuts off before
    # decoding (GIDD's README: `input_ids[:, :-1]`): request.encode drops it from a text prompt.
    prompt_drops_eos: bool = False
    # Block-causal families whose steps read the whole aligned block, the prompt's columns in it
    # included (BD3-LM's sampler draws over its x_block): a step's draws then sit on the same
    # columns whether a row decodes alone or beside rows of other prompt lengths.
    whole_block_window: bool = False
    # The settings the family adds to the shared vocabulary (its rows of settings.SETTINGS, declared
    # in its model file).
    settings: Tuple[Setting, ...] = ()
    # Shared settings its decoder has no use for -> why, and what to set instead (passing one is an
    # error that says so).
    unused_settings: Mapping[str, str] = field(default_factory=dict)
    # Pairs of its settings that must agree (settings.resolve_settings checks them).
    relations: Tuple[Relation, ...] = ()
    # Shared settings the family reads in its own terms: name -> read(value, resolved settings)
    # -> the settings it stands for (DiffusionGemma's temperature scales its t_max -> t_min
    # schedule); it raises SettingsError for a value it cannot honour.
    own_readings: Mapping[str, Callable[[Any, ResolvedSettings], Mapping[str, Any]]] = field(
        default_factory=dict
    )
    # A GIDD-style noise (decoder "gidd"): (min_log_snr, max_log_snr, noise_type), the log-SNR
    # range of a block's steps and the shift of the uniform / mask mixing (config.json's fields).
    noise_log_snr: Tuple[float, ...] = ()
    # The ELBO estimate likelihood.log_likelihood computes for this family (MASK_COUNT_ELBO or
    # TIMESTEP_ELBO); None: it has none.
    likelihood: Optional[str] = None


def for_settings(spec: DiffusionSpec, settings: ResolvedSettings) -> DiffusionSpec:
    """The spec a run of these settings decodes under: `spec` with the fields its sampler brings."""
    fields = spec.sampler_spec.get(settings.sampler)
    return replace(spec, **fields) if fields else spec


def read_generation_config(generation_config: Mapping, keys: Mapping[str, str]) -> dict:
    """{setting: value} for each generation_config.json key in `keys` (key -> setting name) whose
    value is present and not None; a dotted key "a.b" reads a nested entry
    (sampler_config.entropy_bound)."""
    found = {}
    for key, setting in keys.items():
        value = generation_config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            found[setting] = value
    return found
