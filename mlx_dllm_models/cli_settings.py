"""`mlx_dllm settings`: every setting a run with the same model and flags would use, its value and
where it came from, as settings.resolve_with_origins resolves them (the package default, the
family's spec, the sampler, a preset, the checkpoint's generation_config.json, the command line).
The checkpoint's weights are not read: its config and tokenizer are all the resolution needs."""

import sys

from .cli_common import Parser, add_loading_flags, add_setting_flags, chosen_settings, load_for_cli

# How an origin of settings.resolve_with_origins reads here.
ORIGINS = {
    "package": "package default",
    "family": "the {family} family's default",
    "checkpoint": "the checkpoint (generation_config.json)",
    "explicit": "the command line",
}


def settings_parser():
    p = Parser(
        prog="mlx_dllm settings",
        description="Print every setting that `mlx_dllm generate` with these flags would use on "
        "this model, its value and where it came from. The weights are not read.",
    )
    add_loading_flags(p)
    add_setting_flags(p)
    return p


def origin_text(origin: str, family: str) -> str:
    return ORIGINS.get(origin, origin).format(family=family)


def value_text(value) -> str:
    """A value as the flags take it (true / false, none)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


def settings_table(spec, settings, origins) -> str:
    """The settings that act in this run (value, origin), then those that do not and why."""
    from .settings import BY_NAME, out_of_scope

    rows, idle = [], []
    for name, value in settings.as_dict().items():
        why = spec.unused_settings.get(name)
        scope = out_of_scope(BY_NAME[name], settings)
        if why:
            idle.append(f"{name} (not used by the {spec.family} family)")
        elif scope:
            key, among = scope
            idle.append(f"{name} (acts with {key} {' / '.join(among)})")
        else:
            rows.append((name, value_text(value), origin_text(origins[name], spec.family)))
    width = [max(len(r[i]) for r in rows + [("setting", "value")]) for i in (0, 1)]
    lines = [f"{'setting':<{width[0]}}  {'value':<{width[1]}}  from"]
    lines += [f"{n:<{width[0]}}  {v:<{width[1]}}  {o}" for n, v, o in rows]
    if idle:
        lines += ["", "not used by this run:"] + [f"  {line}" for line in idle]
    return "\n".join(lines)


def settings_main(argv):
    from .request import checkpoint_settings
    from .settings import resolve_with_origins

    args = settings_parser().parse_args(argv)
    model, _ = load_for_cli(args, weights=False)
    spec = model.diffusion_spec
    checkpoint = checkpoint_settings(model, spec)
    settings, origins = resolve_with_origins(spec, chosen_settings(args), checkpoint)
    where = args.model or "the embedded model"
    print(f"{where}: the {spec.family} family", file=sys.stdout)
    print(settings_table(spec, settings, origins))
    return 0
