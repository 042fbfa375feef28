"""Decoding settings: one vocabulary across families, defaults from the checkpoint, clear errors.

`SETTINGS` is the one table of the vocabulary: which settings exist, which family, sampler or mode
each belongs to, its package default, its validator and its CLI flag. The shared names, the package
defaults, the CLI's flags and each family's extra settings are all read from it.

Resolution order: explicit arguments, then the checkpoint (generation_config.json, config.json),
then the family's reference defaults (its DiffusionSpec), then the package defaults below.
A family's defaults have one home, its spec (`DiffusionSpec.defaults`, some read from config.json):
the rows of family settings hold none (default None), and the shared rows hold the package defaults.
"""

from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import SettingsError  # noqa: F401  (raised here; importable from here as before)
from .settings_families import DIFFUSION_MODE, DIMPLE_ONLY_ALGS, FAMILY_SETTINGS, Setting
from .validators import (
    a_name,
    cli_optional_float,
    int_at_least,
    int_in,
    number,
    optional,
    positive_int,
    seed_value,
)

# ------------------------------------------------------------------------------------ the table

# The most alternatives the `logprobs` setting lists per token (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
_WHOLE_DISTRIBUTION = "the sampler draws from the whole temperature-scaled distribution"
_WEDLM_STEPS = (
    "a step fills every mask of the window whose entropy (plus the position penalty) is below "
    "entropy_threshold, at least one, so there is no step budget; set entropy_threshold"
)
_WEDLM_THRESHOLD = "its one threshold is on entropy: set entropy_threshold (and pos_penalty_factor)"

# The shared rows, then the families' (settings_families.py).
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
        modes=DIFFUSION_MODE,
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
        modes=DIFFUSION_MODE,
    ),
    Setting(
        "threshold",
        0.9,
        "confidence threshold of the threshold sampler, in (0, 1] (d3llm: entropy bound, nats)",
        float,
        number(0, 1, low_open=True),
        samplers=("threshold", "sub_block", "d3llm"),
        modes=DIFFUSION_MODE,
        unused={"wedlm": _WEDLM_THRESHOLD},
    ),
    Setting(
        "factor",
        1.0,
        "factor of the factor sampler (Fast-dLLM)",
        float,
        number(0, low_open=True),
        samplers=("factor",),
        modes=DIFFUSION_MODE,
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
        modes=DIFFUSION_MODE,
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
) + FAMILY_SETTINGS

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
            alg != "topk_margin" if sampler == "dimple" else alg not in DIMPLE_ONLY_ALGS
        ),
        "alg {alg!r} does not decode with sampler {sampler!r}: sampler 'dimple' takes origin, "
        "origin-ratio, autoregressive, maskgit_plus or entropy; 'dream' takes origin, "
        "maskgit_plus, topk_margin or entropy",
    ),
)


def resolve_settings(spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None):
    """Merge and validate settings for a family. Returns a plain dict with every shared setting and
    every extra setting of the family."""
    return resolve_with_origins(spec, overrides, checkpoint)[0]


def resolve_with_origins(spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None):
    """resolve_settings's values, and where each came from: "package", "family" (its spec),
    "sampler <name>", "preset <setting>=<mode>", "checkpoint" (its generation_config.json, or what
    its remote code implies), "explicit" (the caller's), or "from <setting>" (block_length from
    max_tokens, steps from block_length)."""
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
    origins = dict.fromkeys(values, "package")

    def layer(new, origin):
        values.update(new)
        origins.update(dict.fromkeys(new, origin))

    layer(spec.defaults, "family")
    sampler = explicit.get("sampler", from_checkpoint.get("sampler", values["sampler"]))
    # A sampler that is not a name (a list, a dict) is reported by _validate, not hashed here.
    layer(
        spec.sampler_defaults.get(sampler, {}) if isinstance(sampler, str) else {},
        f"sampler {sampler}",
    )
    # A preset setting (LLaDA2's editing_mode) brings the values of its mode, over the family's
    # defaults and under the checkpoint's and explicit values.
    for name, modes in spec.presets.items():
        mode = explicit.get(name, from_checkpoint.get(name, values.get(name)))
        # A mode that is not a name is reported by _validate.
        layer(modes.get(mode, {}) if isinstance(mode, str) else {}, f"preset {name}={mode}")
    layer(from_checkpoint, "checkpoint")
    layer(explicit, "explicit")
    if values["block_length"] is None:  # one block over the whole generation
        layer({"block_length": values["max_tokens"]}, "from max_tokens")
    if values["steps"] is None:
        # As every reference's default: as many steps as a block has positions, one token per step
        # for the quota sampler; so a new block_length alone keeps that rate.
        layer({"steps": values["block_length"]}, "from block_length")
    _validate(spec, values, explicit, set(from_checkpoint) - set(explicit))
    return values, origins


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


def out_of_scope(name, s) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """("mode" or "sampler", the values it acts with) when setting `name` does not act under the
    resolved settings `s` (another mode's or sampler's); None when it does."""
    row = BY_NAME[name]
    scopes = (("mode", row.modes if "mode" in s else ()), ("sampler", row.samplers))
    off = [(key, scope) for key, scope in scopes if scope and s[key] not in scope]
    return off[0] if off else None


def _validate(spec, s, explicit, from_checkpoint=frozenset()):
    if s["sampler"] not in spec.samplers:
        raise SettingsError(
            f"unknown sampler {s['sampler']!r} for the {spec.family} family; "
            f"choose one of: {', '.join(spec.samplers)}" + _origin(["sampler"], from_checkpoint)
        )
    for name in SHARED_SETTINGS + family_settings(spec.family):
        row = BY_NAME[name]
        given = name in explicit
        # A setting of other modes / samplers: an error when passed, else not checked.
        off = out_of_scope(name, s)
        if off:
            key, scope = off
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
