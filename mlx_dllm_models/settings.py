"""Decoding settings: one vocabulary across families, defaults from the checkpoint, clear errors.

Resolution order: explicit arguments, then the checkpoint (generation_config.json, config.json),
then the family's reference defaults (its DiffusionSpec), then the package defaults below.
"""

import math
from typing import Any, Dict, Mapping, Optional

SHARED_SETTINGS = (
    "max_tokens",
    "block_length",
    "steps",
    "sampler",
    "threshold",
    "factor",
    "entropy_bound",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "cache",
)

PACKAGE_DEFAULTS = {
    "max_tokens": 128,
    "block_length": 32,
    "steps": None,  # = block_length
    "sampler": "quota",
    "threshold": 0.9,
    "factor": 1.0,
    "entropy_bound": 0.1,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "seed": 0,
    "cache": "auto",
}

# generation_config.json keys read for every family (family specs may add more).
GENERATION_CONFIG_KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "block_length": "block_length",
    "threshold": "threshold",
}

# Which samplers a sampler-specific setting acts on: passing it with another sampler is an error,
# never a silently ignored setting.
SAMPLER_SETTINGS = {
    "threshold": ("threshold",),
    "factor": ("factor",),
    "entropy_bound": ("entropy",),
}


class SettingsError(ValueError):
    pass


def resolve_settings(spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None):
    """Merge and validate settings for a family. Returns a plain dict with every shared setting and
    every extra setting of the family."""
    allowed = set(SHARED_SETTINGS) | set(spec.extra_settings)
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise SettingsError(
            f"unknown setting(s) {', '.join(unknown)} for the {spec.family} family; "
            f"it understands: {', '.join(sorted(allowed))}"
        )
    explicit = {k: v for k, v in overrides.items() if v is not None}
    unused = [k for k in explicit if k in spec.unused_settings]
    if unused:
        name = unused[0]
        raise SettingsError(
            f"{name} does not apply to the {spec.family} family: {spec.unused_settings[name]}"
        )
    from_checkpoint = {
        k: v for k, v in (checkpoint or {}).items() if k in allowed and v is not None
    }
    values: Dict[str, Any] = dict(PACKAGE_DEFAULTS)
    values.update({k: None for k in spec.extra_settings if k not in values})
    values.update(spec.defaults)
    sampler = explicit.get("sampler", from_checkpoint.get("sampler", values["sampler"]))
    values.update(spec.sampler_defaults.get(sampler, {}))
    values.update(from_checkpoint)
    values.update(explicit)
    if values["block_length"] is None:
        values["block_length"] = values["max_tokens"]  # one block over the whole generation
    if values["steps"] is None:
        # As every reference's default: as many steps as a block has positions, one token per step
        # for the quota sampler; so a new block_length alone keeps that rate.
        values["steps"] = values["block_length"]
    _validate(spec, values, explicit)
    return values


def _check(cond, msg):
    if not cond:
        raise SettingsError(msg)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(spec, s, explicit):
    _check(
        _is_int(s["max_tokens"]) and s["max_tokens"] >= 1,
        f"max_tokens must be a positive integer, got {s['max_tokens']!r}",
    )
    _check(
        _is_int(s["block_length"]) and s["block_length"] > 0,
        f"block_length must be a positive integer, got {s['block_length']!r}",
    )
    _check(
        _is_int(s["steps"]) and s["steps"] >= 1,
        f"steps must be an integer >= 1 (denoising steps per block), got {s['steps']!r}",
    )
    _check(
        s["sampler"] in spec.samplers,
        f"unknown sampler {s['sampler']!r} for the {spec.family} family; "
        f"choose one of: {', '.join(spec.samplers)}",
    )
    _check(
        isinstance(s["threshold"], (int, float)) and 0 < s["threshold"] <= 1,
        f"threshold must be in (0, 1], got {s['threshold']!r}",
    )
    _check(
        isinstance(s["factor"], (int, float)) and s["factor"] > 0,
        f"factor must be > 0, got {s['factor']!r}",
    )
    _check(
        isinstance(s["entropy_bound"], (int, float)) and s["entropy_bound"] >= 0,
        f"entropy_bound must be >= 0 (nats), got {s['entropy_bound']!r}",
    )
    t = s["temperature"]
    _check(
        isinstance(t, (int, float)) and t >= 0 and math.isfinite(t),
        f"temperature must be a finite number >= 0, got {t!r}",
    )
    if s["top_p"] is not None:
        _check(
            isinstance(s["top_p"], (int, float)) and 0 < s["top_p"] <= 1,
            f"top_p must be in (0, 1], got {s['top_p']!r}",
        )
    if s["top_k"] is not None:
        _check(
            _is_int(s["top_k"]) and s["top_k"] >= 0,
            f"top_k must be an integer >= 0, got {s['top_k']!r}",
        )
    _check(_is_int(s["seed"]), f"seed must be an integer, got {s['seed']!r}")
    caches = ("auto",) + tuple(spec.caches)
    _check(
        s["cache"] in caches,
        f"cache={s['cache']!r} is not available for the {spec.family} family "
        f"({spec.attention} attention); choose one of: {', '.join(caches)}",
    )
    for name, modes in spec.mode_settings.items():
        if name in explicit and s.get("mode") not in modes:
            raise SettingsError(
                f"{name} only acts with mode={modes[0]!r}, but mode is {s.get('mode')!r}; "
                f"pass mode={modes[0]!r} or drop {name}"
            )
    for name, needed in spec.setting_requires.items():
        if name in explicit and s.get(needed) is None:
            raise SettingsError(f"{name} only acts when {needed} is set; pass {needed} or drop {name}")
    scoped = dict(SAMPLER_SETTINGS)
    scoped.update(spec.sampler_settings)
    for name, samplers in scoped.items():
        if name in explicit and s["sampler"] not in samplers:
            raise SettingsError(
                f"{name} only acts with sampler={samplers[0]!r}, but sampler is {s['sampler']!r}; "
                f"pass sampler={samplers[0]!r} or drop {name}"
            )
    for name, check in spec.setting_checks.items():
        if name in explicit or s["sampler"] in scoped.get(name, (s["sampler"],)):
            msg = check(s[name])
            if msg:
                raise SettingsError(msg)
    if spec.confidence == "raw" and t == 0:
        for name in ("top_p", "top_k"):
            if name in explicit:
                raise SettingsError(
                    f"{name} has no effect at temperature 0 for the {spec.family} family "
                    f"(greedy decoding); set temperature > 0 or drop {name}"
                )
