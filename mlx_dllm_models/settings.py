"""Decoding settings: one vocabulary across families, defaults from the checkpoint, clear errors.

`SETTINGS` is the one table of the vocabulary: which settings exist, which family, sampler or mode
each belongs to, its package default, its validator and its CLI flag. The shared names, the package
defaults, the CLI's flags and each family's extra settings are all read from it.

Resolution order: explicit arguments, then the checkpoint (generation_config.json, config.json),
then the family's reference defaults (its DiffusionSpec), then the package defaults below.
A family's defaults have one home, its spec (`DiffusionSpec.defaults`, some read from config.json):
the rows of family settings hold none (default None), and the shared rows hold the package defaults.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from .errors import SettingsError  # noqa: F401  (raised here; importable from here as before)
from .validators import (
    a_name,
    choice,
    cli_bool,
    cli_optional_float,
    int_at_least,
    int_in,
    number,
    optional,
    positive_int,
    seed_value,
    true_or_false,
)

# ------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Setting:
    name: str
    # A shared setting's package default (None: unset, or the family spec's). A family setting's
    # row holds None: a family's defaults live in its spec (DiffusionSpec.defaults) only.
    default: Any
    help: str  # CLI help
    cli_type: Callable[[str], Any]  # argparse type of the CLI flag
    check: Optional[Callable[[Any], Optional[str]]] = None
    # Families whose decoders read it; empty for a shared setting of every family.
    families: Tuple[str, ...] = ()
    # Samplers it acts with; empty for any. Passing it with another sampler is an error.
    samplers: Tuple[str, ...] = ()
    # Values of a family's `mode` setting it acts in (for families that have one); empty for any.
    modes: Tuple[str, ...] = ()
    # Another setting it only acts with (e.g. max_post_steps needs editing_threshold).
    requires: Optional[str] = None
    # Families whose decoder has no use for this shared setting -> why, and what to set instead.
    unused: Mapping[str, str] = field(default_factory=dict)
    # A token id: checked against the family's vocabulary (DiffusionSpec.vocab_size) and mask id.
    token_id: bool = False


# The most alternatives the `logprobs` setting lists per token (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
_DIFFUSION = ("diffusion",)  # Nemotron: the samplers act in diffusion mode, not self-speculation
_WHOLE_DISTRIBUTION = "the sampler draws from the whole temperature-scaled distribution"
_CANVAS = ("diffusion_gemma",)
# Families whose sampler "dream" is Dream's diffusion_generate (CoDA's, Open-dCoder's: adaptations).
_DREAM = ("dream", "coda", "open_dcoder")


# Dream's algorithms (decoding/dream.py) and those only Dimple's "dim" pipeline has
# (decoding/dimple.py, which has no topk_margin).
_DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
_DIMPLE_ONLY_ALGS = ("origin-ratio", "autoregressive")


def _d3llm(name, what, check=number(0, 1), cli_type=float):
    """A setting of the d3llm sampler (d3LLM's generate_multi_block, LLaDA and Dream)."""
    return Setting(name, None, f"d3LLM: {what}", cli_type, check, ("llada", "dream"), ("d3llm",))


_OPEN_SHARE = number(0, 1, low_open=True)

_WEDLM_STEPS = (
    "a step fills every mask of the window whose entropy (plus the position penalty) is below "
    "entropy_threshold, at least one, so there is no step budget; set entropy_threshold"
)
_WEDLM_THRESHOLD = "its one threshold is on entropy: set entropy_threshold (and pos_penalty_factor)"

SETTINGS: Tuple[Setting, ...] = (
    Setting("max_tokens", 128, "new tokens at most (EOS may end earlier)", int, positive_int),
    Setting(
        "block_length",
        32,
        "positions per block",
        int,
        positive_int,
        unused={
            "diffusion_gemma": "each canvas is a block; set min_canvas_length / max_canvas_length"
        },
    ),
    Setting(
        "steps",
        None,
        "denoising steps per block (default: block_length)",
        int,
        int_at_least(1, " (denoising steps per block)"),
        modes=_DIFFUSION,
        unused={
            "diffusion_gemma": "set max_denoising_steps (an upper bound per canvas: a canvas stops "
            "once its argmax is stable and confident)",
            "wedlm": _WEDLM_STEPS,
        },
    ),
    Setting(
        "sampler",
        "quota",
        "quota | threshold | factor | entropy (a family may add its own)",
        str,
        modes=_DIFFUSION,
    ),
    Setting(
        "threshold",
        0.9,
        "confidence threshold of the threshold sampler, in (0, 1] (d3llm: entropy bound, nats)",
        float,
        number(0, 1, low_open=True),
        samplers=("threshold", "sub_block", "d3llm"),
        modes=_DIFFUSION,
        unused={"wedlm": _WEDLM_THRESHOLD},
    ),
    Setting(
        "factor",
        1.0,
        "factor of the factor sampler (Fast-dLLM)",
        float,
        number(0, low_open=True),
        samplers=("factor",),
        modes=_DIFFUSION,
        unused={
            "diffusion_gemma": "its samplers are 'entropy' (entropy_bound) and 'threshold' (threshold)",
            "wedlm": _WEDLM_THRESHOLD,
        },
    ),
    Setting(
        "entropy_bound",
        0.1,
        "entropy budget of the entropy sampler (EB-Sampler), in nats",
        float,
        number(0, what=" (nats)"),
        samplers=("entropy",),
        modes=_DIFFUSION,
        unused={"wedlm": _WEDLM_THRESHOLD},
    ),
    Setting(
        "temperature",
        0.0,
        "sampling temperature; 0 is greedy",
        float,
        number(0, finite=True),
        unused={
            "diffusion_gemma": "the temperature follows a schedule from t_max (first step) to t_min; "
            "set those"
        },
    ),
    Setting(
        "top_p",
        None,
        "nucleus filtering",
        cli_optional_float,
        optional(number(0, 1, low_open=True)),
        unused={"diffusion_gemma": _WHOLE_DISTRIBUTION},
    ),
    Setting(
        "top_k",
        None,
        "top-k filtering",
        int,
        optional(int_at_least(0)),
        unused={"diffusion_gemma": _WHOLE_DISTRIBUTION},
    ),
    Setting("seed", 0, "PRNG seed", int, seed_value),
    # Read by every loop, changes no token: each returned token's log-probability at the step
    # that committed it, with this many alternatives (engine.base.TokenLogprob); none: off.
    Setting(
        "logprobs",
        None,
        f"report each token's log-probability and this many alternatives (0-{MAX_LOGPROBS})",
        int,
        optional(int_in(0, MAX_LOGPROBS, " (alternatives per token, as OpenAI's bound)")),
    ),
    # Validated against the backend table of the family's attention layout (engine.registry).
    Setting(
        "cache",
        "auto",
        "auto | none | a cache the family's attention layout offers",
        str,
        a_name,
    ),
    # Dream's diffusion_generate.
    Setting(
        "alg",
        None,
        "Dream: origin | maskgit_plus | topk_margin | entropy (sampler 'dimple': origin | "
        "origin-ratio | autoregressive | maskgit_plus | entropy)",
        str,
        choice(_DREAM_ALGS + _DIMPLE_ONLY_ALGS, " for sampler 'dream' or 'dimple'"),
        families=_DREAM,
        samplers=("dream", "dimple"),
    ),
    Setting(
        "alg_temp",
        None,
        "Dream: temperature of the confidence ranking (0 or none ranks greedily)",
        cli_optional_float,
        optional(number(0, what=" (0 or null ranks greedily)")),
        families=_DREAM,
        samplers=("dream", "dimple"),
    ),
    Setting(
        "eps",
        None,
        "Dream: the last timestep of its schedule, in (0, 1)",
        float,
        number(
            0, 1, low_open=True, high_open=True, what=" (the last timestep of Dream's schedule)"
        ),
        families=_DREAM,
        samplers=("dream", "dimple"),
    ),
    # Dimple's "dim" pipeline (yu-rp/Dimple generation_utils.py): its confident decoding.
    Setting(
        "alg_p_threshold",
        None,
        "Dimple: confident decoding, commit every mask whose probability exceeds it (0 or none: "
        "off)",
        cli_optional_float,
        optional(number(0, 1, what=" (0 or null: off)")),
        families=("dream",),
        samplers=("dimple",),
    ),
    # LLaDA generate.py (ML-GSAI/LLaDA), LLaDA 8B and LLaDA-MoE.
    Setting(
        "cfg_scale",
        None,
        "LLaDA: classifier-free guidance scale (0: off); the unconditional row masks the prompt",
        float,
        number(0, finite=True, what=" (0 turns guidance off)"),
        families=("llada",),
    ),
    Setting(
        "logits_eos_inf",
        None,
        "LLaDA: never propose EOS (its logit is -inf), as generate.py's logits_eos_inf",
        cli_bool,
        true_or_false,
        families=("llada",),
    ),
    Setting(
        "confidence_eos_eot_inf",
        None,
        "LLaDA: a proposed end-of-turn token gets confidence 0, as generate.py's "
        "confidence_eos_eot_inf",
        cli_bool,
        true_or_false,
        families=("llada",),
    ),
    # LaViDa's generate (decoding/lavida.py): the quota of each step follows a noise schedule.
    Setting(
        "schedule",
        None,
        "LaViDa (sampler 'lavida'): shift | linear, the noise schedule the step quotas follow",
        str,
        optional(choice(("shift", "linear"), " for sampler 'lavida'")),
        families=("llada",),
        samplers=("lavida",),
    ),
    Setting(
        "schedule_shift",
        None,
        "LaViDa: the shift of schedule 'shift' (default 3; run_coco.sh uses 0.33)",
        float,
        optional(number(0, low_open=True, finite=True)),
        families=("llada",),
        samplers=("lavida",),
    ),
    # RND1 sampling.py's entropy-bounded variant of its sampler.
    Setting(
        "eb_gamma",
        None,
        "RND1: entropy budget of the rnd1 sampler's entropy-bounded variant (sampling.py's "
        "eb_gamma; none: the reference's quota schedule)",
        cli_optional_float,
        optional(number(0, what=" (nats)")),
        families=("rnd1",),
        samplers=("rnd1",),
    ),
    # SDAR generate.py's entropy_bounded remasking.
    Setting(
        "eb_threshold",
        None,
        "SDAR: entropy budget of the entropy_bounded sampler (generate.py's eb_threshold)",
        float,
        number(0, low_open=True),
        families=("sdar",),
        samplers=("entropy_bounded",),
    ),
    _d3llm("block_size", "positions per block of its pipeline", positive_int, int),
    _d3llm("block_add_threshold", "open a block at this share of the last decoded", _OPEN_SHARE),
    _d3llm("decoded_token_threshold", "fully active once the block before is this share decoded"),
    _d3llm("early_stop", "positions after a decoded EOS become EOS", true_or_false, cli_bool),
    # Fast-dLLM v2's generate: small_block_size, the sub-blocks a block is decoded in.
    Setting(
        "sub_block_length",
        None,
        "Fast-dLLM v2: positions per sub-block of the sub_block sampler (divides block_length)",
        int,
        positive_int,
        families=("fast_dllm_v2",),
        samplers=("sub_block",),
    ),
    # WeDLM's SamplingParams (wedlm/sampling_params.py); its window is block_length.
    Setting(
        "entropy_threshold",
        None,
        "WeDLM: fill every mask whose entropy plus the position penalty is below this, at least "
        "one (wedlm_entropy_threshold; 0: one mask a step, the least, as the reference's None)",
        cli_optional_float,
        optional(number(0, what=" (nats)")),
        families=("wedlm",),
        samplers=("wedlm",),
    ),
    Setting(
        "pos_penalty_factor",
        None,
        "WeDLM: added to a mask's entropy per position after the window's first mask "
        "(wedlm_pos_penalty_factor)",
        float,
        number(0, finite=True),
        families=("wedlm",),
        samplers=("wedlm",),
    ),
    # LLaDA2.1 / 2.2 decoding modes: the spec's presets (llada2_moe.LLADA2_EDITING_MODES, the one
    # place of their numbers) map a mode to settings; explicit settings win over the mode.
    Setting(
        "editing_mode",
        None,
        "LLaDA2: quality | speed (the LLaDA2.1 model card's Quality / Speed Mode: threshold and "
        "editing_threshold) | off (2.0's generate, no editing); default: quality for 2.1 / 2.2 "
        "checkpoints, off for 2.0",
        str,
        choice(("quality", "speed", "off"), " for the llada2 family"),
        families=("llada2",),
    ),
    # LLaDA2.1 token editing.
    Setting(
        "editing_threshold",
        None,
        "LLaDA2.1: rewrite a committed token when another is proposed above this probability "
        "(none: editing off)",
        cli_optional_float,
        optional(
            number(
                0,
                1,
                what=" (a committed token is rewritten when the model proposes another "
                "one with a probability above it) or None to turn editing off",
            )
        ),
        families=("llada2",),
    ),
    Setting(
        "max_post_steps",
        None,
        "LLaDA2.1: editing forwards after a block has no masks left",
        int,
        int_at_least(0, " (editing forwards after a block has no masks left)"),
        families=("llada2",),
        requires="editing_threshold",
    ),
    # Nemotron-Labs-Diffusion.
    Setting(
        "mode",
        None,
        "Nemotron: diffusion | self_spec (lossless self-speculation)",
        str,
        choice(("diffusion", "self_spec"), " for the nemotron family"),
        families=("nemotron",),
    ),
    Setting(
        "draft_threshold",
        None,
        "Nemotron self_spec: linear_spec_generate's threshold: drafts over several forwards, each "
        "revealing the masks whose confidence reaches it (none: one draft forward)",
        cli_optional_float,
        optional(number(0, 1, low_open=True, what=" (linear_spec_generate's threshold)")),
        families=("nemotron",),
        modes=("self_spec",),
    ),
    # NVIDIA's chat_utils.generate_with_prefix_cache_block_diff (the remote code's
    # generate_diffusion), read by the causal-prefix backend (engine/causal_prefix.py).
    Setting(
        "causal_context",
        None,
        "Nemotron: true: the context (prompt, finished blocks) is causal and the AR head seeds "
        "each block; false: the prompt and each finished block attend bidirectionally within "
        "themselves and to what precedes them, and blocks start as masks",
        cli_bool,
        true_or_false,
        families=("nemotron",),
        modes=_DIFFUSION,
    ),
    Setting(
        "max_thinking_tokens",
        None,
        "Nemotron: thinking budget: a row that has not produced end_think_token_id within this "
        "many new tokens gets it at that position (with end_think_token_id)",
        int,
        optional(int_at_least(0, " (new tokens before end_think_token_id is forced)")),
        families=("nemotron",),
        requires="end_think_token_id",
    ),
    Setting(
        "end_think_token_id",
        None,
        "Nemotron: the token that ends thinking (e.g. the id of </think>), forced at "
        "max_thinking_tokens",
        int,
        optional(int_at_least(0, " (a token id)")),
        families=("nemotron",),
        requires="max_thinking_tokens",
        token_id=True,
    ),
    # DiffusionGemma's canvas decoder.
    Setting(
        "max_denoising_steps",
        None,
        "DiffusionGemma: denoising steps per canvas at most",
        int,
        int_at_least(1),
        families=_CANVAS,
    ),
    Setting(
        "t_min",
        None,
        "DiffusionGemma: temperature of the last step",
        float,
        number(0),
        families=_CANVAS,
    ),
    Setting(
        "t_max",
        None,
        "DiffusionGemma: temperature of the first step",
        float,
        number(0, low_open=True),
        families=_CANVAS,
    ),
    Setting(
        "stability_threshold",
        None,
        "DiffusionGemma: steps the argmax must stay unchanged to stop a canvas",
        int,
        int_at_least(0),
        families=_CANVAS,
    ),
    Setting(
        "confidence_threshold",
        None,
        "DiffusionGemma: mean entropy below which a stable canvas stops",
        float,
        number(0),
        families=_CANVAS,
    ),
    Setting(
        "min_canvas_length",
        None,
        "DiffusionGemma: shortest last canvas (default: the trained canvas length, as "
        "transformers; lower it to shorten the last canvas to the tokens still wanted)",
        int,
        int_at_least(1),
        families=_CANVAS,
    ),
    Setting(
        "max_canvas_length",
        None,
        "DiffusionGemma: longest canvas (the trained length)",
        int,
        int_at_least(1),
        families=_CANVAS,
    ),
)

BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
SHARED_SETTINGS = tuple(s.name for s in SETTINGS if not s.families)
PACKAGE_DEFAULTS = {s.name: s.default for s in SETTINGS if not s.families}


def family_settings(family: str) -> Tuple[str, ...]:
    """The settings a family understands beyond the shared vocabulary."""
    return tuple(s.name for s in SETTINGS if family in s.families)


# Pairs of settings that must agree: (first, second, holds(first, second), message).
_RELATIONS = (
    (
        "sub_block_length",
        "block_length",
        lambda sub, block: block % sub == 0,
        "sub_block_length ({sub_block_length}) must divide block_length ({block_length}): a block "
        "is decoded as whole sub-blocks",
    ),
    (
        "t_min",
        "t_max",
        lambda lo, hi: hi >= lo,
        "t_max ({t_max}) is the first step's temperature and must be >= t_min ({t_min}), the last step's",
    ),
    (
        "min_canvas_length",
        "max_canvas_length",
        lambda lo, hi: lo <= hi,
        "min_canvas_length ({min_canvas_length}) exceeds max_canvas_length ({max_canvas_length})",
    ),
    (
        "alg",
        "sampler",
        lambda alg, sampler: (
            alg != "topk_margin" if sampler == "dimple" else alg not in _DIMPLE_ONLY_ALGS
        ),
        "alg {alg!r} does not decode with sampler {sampler!r}: sampler 'dimple' takes origin, "
        "origin-ratio, autoregressive, maskgit_plus or entropy; 'dream' takes origin, "
        "maskgit_plus, topk_margin or entropy",
    ),
)


def resolve_settings(spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None):
    """Merge and validate settings for a family. Returns a plain dict with every shared setting and
    every extra setting of the family."""
    extras = family_settings(spec.family)
    allowed = set(SHARED_SETTINGS) | set(extras)
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        # Another family's setting (LLaDA's cfg_scale on Dream): say whose it is.
        whose = "".join(
            f"; {n} is a setting of the {' / '.join(BY_NAME[n].families)} family only"
            for n in unknown
            if n in BY_NAME
        )
        raise SettingsError(
            f"unknown setting(s) {', '.join(unknown)} for the {spec.family} family; "
            f"it understands: {', '.join(sorted(allowed))}{whose}"
        )
    explicit = {k: v for k, v in overrides.items() if v is not None}
    for name in explicit:
        why = BY_NAME[name].unused.get(spec.family)
        if why:
            raise SettingsError(f"{name} does not apply to the {spec.family} family: {why}")
    from_checkpoint = {
        k: v for k, v in (checkpoint or {}).items() if k in allowed and v is not None
    }
    values: Dict[str, Any] = {name: BY_NAME[name].default for name in SHARED_SETTINGS + extras}
    values.update(spec.defaults)
    sampler = explicit.get("sampler", from_checkpoint.get("sampler", values["sampler"]))
    # A sampler that is not a name (a list, a dict) is reported by _validate, not hashed here.
    values.update(spec.sampler_defaults.get(sampler, {}) if isinstance(sampler, str) else {})
    # A preset setting (LLaDA2's editing_mode) brings the values of its mode, over the family's
    # defaults and under the checkpoint's and explicit values.
    for name, modes in spec.presets.items():
        mode = explicit.get(name, from_checkpoint.get(name, values.get(name)))
        values.update(modes.get(mode, {}) if isinstance(mode, str) else {})  # else: _validate
    values.update(from_checkpoint)
    values.update(explicit)
    if values["block_length"] is None:
        values["block_length"] = values["max_tokens"]  # one block over the whole generation
    if values["steps"] is None:
        # As every reference's default: as many steps as a block has positions, one token per step
        # for the quota sampler; so a new block_length alone keeps that rate.
        values["steps"] = values["block_length"]
    _validate(spec, values, explicit, set(from_checkpoint) - set(explicit))
    return values


def _origin(names, from_checkpoint) -> str:
    """Where a bad value came from, when the user did not pass it: otherwise the message would send
    them looking for an argument they never gave."""
    read = [n for n in names if n in from_checkpoint]
    if not read:
        return ""
    return (
        f" ({', '.join(read)} comes from the checkpoint's generation_config.json: pass it to "
        "override the file's value, or correct the file)"
    )


def _token_id_error(spec, name, v) -> Optional[str]:
    """A token id the decoder writes into the canvas must be a real token: inside the vocabulary
    (else the embedding lookup fails deep in mlx), and not the mask (it would be decoded over)."""
    if spec.vocab_size is not None and v >= spec.vocab_size:
        return (
            f"{name} {v} is outside the vocabulary (vocab_size {spec.vocab_size}: token ids run "
            f"from 0 to {spec.vocab_size - 1}); pass the tokenizer's id of the token"
        )
    if v == spec.mask_token_id:
        return f"{name} {v} is the mask token id; pass the id of the token itself"
    return None


def _validate(spec, s, explicit, from_checkpoint=frozenset()):
    if s["sampler"] not in spec.samplers:
        raise SettingsError(
            f"unknown sampler {s['sampler']!r} for the {spec.family} family; "
            f"choose one of: {', '.join(spec.samplers)}" + _origin(["sampler"], from_checkpoint)
        )
    has_modes = "mode" in s
    for name in SHARED_SETTINGS + family_settings(spec.family):
        row = BY_NAME[name]
        given = name in explicit
        # A setting of other modes / samplers: an error when passed, else not checked.
        scopes = (("mode", row.modes if has_modes else ()), ("sampler", row.samplers))
        off = [(key, scope) for key, scope in scopes if scope and s[key] not in scope]
        if off:
            key, scope = off[0]
            if given:
                raise SettingsError(
                    f"{name} only acts with {key}={scope[0]!r}, but {key} is {s[key]!r}; "
                    f"pass {key}={scope[0]!r} or drop {name}"
                )
            continue
        if row.requires and given and s.get(row.requires) is None:
            raise SettingsError(
                f"{name} only acts when {row.requires} is set; pass {row.requires} or drop {name}"
            )
        if row.unused.get(spec.family) or row.check is None:
            continue
        msg = row.check(name, s[name])
        if msg is None and row.token_id and s[name] is not None:
            msg = _token_id_error(spec, name, s[name])
        if msg:
            raise SettingsError(msg + _origin([name], from_checkpoint))
    for first, second, holds, message in _RELATIONS:
        if s.get(first) is not None and s.get(second) is not None:
            if not holds(s[first], s[second]):
                raise SettingsError(message.format(**s) + _origin([first, second], from_checkpoint))
    # The sampler's confidence (a sampler may bring its own: Dimple's "dream" reads the processed
    # distribution, where top-p acts at temperature 0 too).
    confidence = spec.sampler_spec.get(s["sampler"], {}).get("confidence", spec.confidence)
    if confidence == "raw" and s["temperature"] == 0:
        for name in ("top_p", "top_k"):
            if name in explicit:
                raise SettingsError(
                    f"{name} has no effect at temperature 0 for the {spec.family} family "
                    f"(greedy decoding); set temperature > 0 or drop {name}"
                )
