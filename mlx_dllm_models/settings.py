"""Decoding settings: one vocabulary across families, defaults from the checkpoint, clear errors.

`SETTINGS` is the one table of the vocabulary: which settings exist, which family, sampler or mode
each belongs to, its package default, its validator and its CLI flag: the shared rows here, then
the rows each family declares in its model file (collected on first use). Resolving one family's
settings reads the shared rows and its spec (its rows, the shared settings it has no use for or
reads in its own terms, the pairs that must agree); the CLI's flags read the whole table through
its index (settings_index, generated from this table), which imports no model module.

Resolution order: explicit arguments, then the checkpoint (generation_config.json, config.json),
then the family's reference defaults (its DiffusionSpec), then the package defaults below.
A family's defaults have one home, its spec (`DiffusionSpec.defaults`, some read from config.json):
the rows of family settings hold none (default None), and the shared rows hold the package defaults.
"""

import importlib
from dataclasses import replace
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import SettingsError  # noqa: F401  (raised here, so callers may catch it as settings')
from .registry import MODEL_TYPES
from .settings_families import DIFFUSION_MODE, Setting
from .settings_fields import ResolvedSettings
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

# The shared rows: every family reads them, except those its spec lists as unused
# (DiffusionSpec.unused_settings) or reads in its own terms (DiffusionSpec.own_readings).
SHARED_ROWS: Tuple[Setting, ...] = (
    Setting("max_tokens", 128, "new tokens at most (EOS may end earlier)", int, positive_int),
    Setting("block_length", 32, "positions per block", int, positive_int),
    Setting(
        "steps",
        None,
        "denoising steps per block (default: block_length)",
        int,
        int_at_least(1, " (denoising steps per block)"),
        modes=DIFFUSION_MODE,
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
    ),
    Setting(
        "factor",
        1.0,
        "factor of the factor sampler (Fast-dLLM)",
        float,
        number(0, low_open=True),
        samplers=("factor",),
        modes=DIFFUSION_MODE,
    ),
    Setting(
        "entropy_bound",
        0.1,
        "entropy budget of the entropy sampler (EB-Sampler), in nats",
        float,
        number(0, what=" (nats)"),
        samplers=("entropy",),
        modes=DIFFUSION_MODE,
    ),
    Setting("temperature", 0.0, "sampling temperature; 0 is greedy", float, number(0, finite=True)),
    Setting(
        "top_p",
        None,
        "nucleus filtering",
        cli_optional_float,
        optional(number(0, 1, low_open=True)),
    ),
    Setting("top_k", None, "top-k filtering", int, optional(int_at_least(0))),
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
)

SHARED_BY_NAME: Dict[str, Setting] = {s.name: s for s in SHARED_ROWS}
SHARED_SETTINGS = tuple(SHARED_BY_NAME)
PACKAGE_DEFAULTS = {s.name: s.default for s in SHARED_ROWS}


def _family_modules():
    """Every registered family's model module (registry.MODEL_TYPES'), each once, in its order."""
    for module_name in dict.fromkeys(MODEL_TYPES.values()):
        yield importlib.import_module(f"{__package__}.models.{module_name}")


def _family_samplers() -> Tuple[str, ...]:
    """The sampler names the model files declare: their own commit rules (SAMPLERS) and the
    samplers of the loops they register (DECODERS), each once."""
    names: Dict[str, None] = {}
    for module in _family_modules():
        names.update(dict.fromkeys(vars(module).get("SAMPLERS", {})))
        for decoder in vars(module).get("DECODERS", {}).values():
            names.update(dict.fromkeys(decoder.samplers))
    return tuple(names)


def _collect() -> Tuple[Setting, ...]:
    """The shared rows, then the rows of every registered family (registry.MODEL_TYPES' modules,
    each declaring FAMILY, SETTINGS and, where it has them, UNUSED_SETTINGS), each row carrying the
    families that declare it (`families`) and, for a shared row, the families that have no use for
    it (`unused`)."""
    families: Dict[str, list] = {}
    rows: Dict[str, Setting] = {}
    unused: Dict[str, Dict[str, str]] = {name: {} for name in SHARED_SETTINGS}
    for module in _family_modules():
        for row in module.SETTINGS:
            rows.setdefault(row.name, row)
            declared = families.setdefault(row.name, [])
            if module.FAMILY not in declared:
                declared.append(module.FAMILY)
        for name, why in vars(module).get("UNUSED_SETTINGS", {}).items():
            unused[name][module.FAMILY] = why
    shared = tuple(replace(row, unused=unused[row.name]) for row in SHARED_ROWS)
    return shared + tuple(replace(row, families=tuple(families[n])) for n, row in rows.items())


def __getattr__(name: str):
    """SETTINGS (the one table: the shared rows, then every registered family's), BY_NAME (its
    rows by name), FAMILY_SETTINGS (the families' rows) and FAMILY_SAMPLERS (the sampler names
    the model files declare), built on first use: they import every family's model module, which
    deciding one family's settings never needs."""
    if name == "FAMILY_SAMPLERS":
        globals()[name] = _family_samplers()
        return globals()[name]
    if name not in ("SETTINGS", "BY_NAME", "FAMILY_SETTINGS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    table = _collect()
    globals().update(
        SETTINGS=table,
        BY_NAME={s.name: s for s in table},
        FAMILY_SETTINGS=table[len(SHARED_ROWS) :],
    )
    return globals()[name]


def _table(name: str):
    return globals()[name] if name in globals() else __getattr__(name)


# The filters' values that keep every token: a nucleus of 1, a top-k of 0 (what OpenAI clients
# send by default). Such a value is never refused as having no effect: it asks for none.
NO_FILTER = {"top_p": 1, "top_k": 0}


def filters_nothing(name: str, value) -> bool:
    return name in NO_FILTER and not isinstance(value, bool) and value == NO_FILTER[name]


def family_settings(family: str) -> Tuple[str, ...]:
    """The settings a family understands beyond the shared vocabulary."""
    return tuple(s.name for s in _table("FAMILY_SETTINGS") if family in s.families)


def resolve_settings(
    spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None
) -> ResolvedSettings:
    """Merge and validate settings for a family. Returns the resolved settings, holding every
    shared setting and every extra setting of the family (the rows its spec declares,
    `spec.settings`) as present."""
    return resolve_with_origins(spec, overrides, checkpoint)[0]


def resolve_with_origins(
    spec, overrides: Mapping[str, Any], checkpoint: Optional[Mapping] = None
) -> Tuple[ResolvedSettings, Dict[str, str]]:
    """resolve_settings's values, and where each came from: "package", "family" (its spec),
    "sampler <name>", "preset <setting>=<mode>", "checkpoint" (its generation_config.json, or what
    its remote code implies), "explicit" (the caller's), "from <setting>" (block_length from
    max_tokens, steps from block_length), or "reading of <setting>" (a shared setting the family
    reads in its own terms)."""
    rows = dict(SHARED_BY_NAME, **{row.name: row for row in spec.settings})
    unknown = sorted(set(overrides) - set(rows))
    if unknown:
        # Another family's setting (LLaDA's cfg_scale on Dream): say whose it is.
        by_name = _table("BY_NAME")
        whose = "".join(
            f"; {n} is a setting of the {' / '.join(by_name[n].families)} family only"
            for n in unknown
            if n in by_name
        )
        raise SettingsError(
            f"unknown setting(s) {', '.join(unknown)} for the {spec.family} family; "
            f"it understands: {', '.join(sorted(rows))}{whose}"
        )
    explicit = {k: v for k, v in overrides.items() if v is not None}
    # Shared settings the family reads in its own terms, applied once the rest is resolved.
    readings = {name: explicit.pop(name) for name in spec.own_readings if name in explicit}
    for name in list(explicit):
        why = spec.unused_settings.get(name)
        if why and filters_nothing(name, explicit[name]):
            del explicit[name]  # asks for nothing of a family that has no use for it
        elif why:
            raise SettingsError(f"{name} does not apply to the {spec.family} family: {why}")
    from_checkpoint = {k: v for k, v in (checkpoint or {}).items() if k in rows and v is not None}
    values: Dict[str, Any] = {name: row.default for name, row in rows.items()}
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
    resolved = ResolvedSettings.from_dict(values)
    _validate(spec, rows, resolved, explicit, set(from_checkpoint) - set(explicit))
    for name, value in readings.items():
        origins[name] = "explicit"
        read = spec.own_readings[name](value, resolved)
        resolved = replace(resolved, **read)
        origins.update(dict.fromkeys(read, f"reading of {name}"))
    return resolved, origins


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


def out_of_scope(row, s) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """("mode" or "sampler", the values it acts with) when the setting of `row` does not act under
    the resolved settings `s` (another mode's or sampler's); None when it does."""
    scopes = (("mode", row.modes if s.has("mode") else ()), ("sampler", row.samplers))
    off = [(key, scope) for key, scope in scopes if scope and getattr(s, key) not in scope]
    return off[0] if off else None


def _validate(spec, rows, s, explicit, from_checkpoint=frozenset()):
    if s.sampler not in spec.samplers:
        raise SettingsError(
            f"unknown sampler {s.sampler!r} for the {spec.family} family; "
            f"choose one of: {', '.join(spec.samplers)}" + _origin(["sampler"], from_checkpoint)
        )
    for name, row in rows.items():
        given = name in explicit
        # A setting of other modes / samplers: an error when passed, else not checked.
        off = out_of_scope(row, s)
        if off:
            key, scope = off
            if given:
                raise SettingsError(
                    f"{name} only acts with {key}={scope[0]!r}, but {key} is {getattr(s, key)!r}; "
                    f"pass {key}={scope[0]!r} or drop {name}"
                )
            continue
        if row.requires and given and getattr(s, row.requires) is None:
            raise SettingsError(
                f"{name} only acts when {row.requires} is set; pass {row.requires} or drop {name}"
            )
        if name in spec.unused_settings or row.check is None:
            continue
        value = getattr(s, name)
        msg = row.check(name, value)
        if msg is None and row.token_id and value is not None:
            msg = _token_id_error(spec, name, value)
        if msg:
            raise SettingsError(msg + _origin([name], from_checkpoint))
    for rel in spec.relations:
        first, second = getattr(s, rel.first), getattr(s, rel.second)
        if first is not None and second is not None and not rel.holds(first, second):
            where = _origin([rel.first, rel.second], from_checkpoint)
            raise SettingsError(rel.message.format(**s.as_dict()) + where)
    # The sampler's confidence (a sampler may bring its own: Dimple's "dream" reads the processed
    # distribution, where top-p acts at temperature 0 too).
    confidence = spec.sampler_spec.get(s.sampler, {}).get("confidence", spec.confidence)
    if confidence == "raw" and s.temperature == 0:
        for name in ("top_p", "top_k"):
            if name in explicit and not filters_nothing(name, explicit[name]):
                raise SettingsError(
                    f"{name} has no effect at temperature 0 for the {spec.family} family "
                    f"(greedy decoding); set temperature > 0 or drop {name}"
                )
