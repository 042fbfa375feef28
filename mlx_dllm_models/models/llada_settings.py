"""The llada settings family: the rows that LLaDA's checkpoints (LLaDA 8B, LLaDA-MoE, LLaDA-V,
LaViDa-LLaDA) add to the shared settings, from LLaDA's generate.py (ML-GSAI/LLaDA), LaViDa's
generate and d3LLM's multi-block decoding. Apart from models/llada.py for its length only."""

from ..settings_families import D3LLM_SETTINGS, Setting
from ..validators import choice, cli_bool, number, optional, true_or_false

# The settings family of LLaDA's specs (the settings table groups rows by it).
FAMILY = "llada"

SETTINGS = (
    Setting(
        "cfg_scale",
        None,
        "LLaDA: classifier-free guidance scale (0: off); the unconditional row masks the prompt",
        float,
        number(0, finite=True, what=" (0 turns guidance off)"),
    ),
    Setting(
        "logits_eos_inf",
        None,
        "LLaDA: never propose EOS (its logit is -inf), as generate.py's logits_eos_inf",
        cli_bool,
        true_or_false,
    ),
    Setting(
        "confidence_eos_eot_inf",
        None,
        "LLaDA: a proposed end-of-turn token gets confidence 0, as generate.py's "
        "confidence_eos_eot_inf",
        cli_bool,
        true_or_false,
    ),
    # LaViDa's generate (decoding/lavida.py): the quota of each step follows a noise schedule.
    Setting(
        "schedule",
        None,
        "LaViDa (sampler 'lavida'): shift | linear, the noise schedule the step quotas follow",
        str,
        optional(choice(("shift", "linear"), " for sampler 'lavida'")),
        samplers=("lavida",),
    ),
    Setting(
        "schedule_shift",
        None,
        "LaViDa: the shift of schedule 'shift' (default 3; run_coco.sh uses 0.33)",
        float,
        optional(number(0, low_open=True, finite=True)),
        samplers=("lavida",),
    ),
) + D3LLM_SETTINGS
