"""The family rows of the settings table (settings.SETTINGS is the shared rows, then these), and the
row type itself. Each row belongs to the families that read it (`families`), and holds no default:
a family's defaults live in its spec (DiffusionSpec.defaults). Split from settings.py, which keeps
the shared rows and the resolution, for length only: there is still one table.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple

from .validators import (
    choice,
    cli_bool,
    cli_optional_float,
    int_at_least,
    number,
    optional,
    positive_int,
    true_or_false,
)


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


# Nemotron: the samplers act in diffusion mode, not self-speculation.
DIFFUSION_MODE = ("diffusion",)
_CANVAS = ("diffusion_gemma",)
# Families whose sampler "dream" is Dream's diffusion_generate (CoDA's, Open-dCoder's: adaptations).
_DREAM = ("dream", "coda", "open_dcoder")

# Dream's algorithms (decoding/dream.py) and those only Dimple's "dim" pipeline has
# (decoding/dimple.py, which has no topk_margin).
_DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DIMPLE_ONLY_ALGS = ("origin-ratio", "autoregressive")


def _d3llm(name, what, check=number(0, 1), cli_type=float):
    """A setting of the d3llm sampler (d3LLM's generate_multi_block, LLaDA and Dream)."""
    return Setting(name, None, f"d3LLM: {what}", cli_type, check, ("llada", "dream"), ("d3llm",))


_OPEN_SHARE = number(0, 1, low_open=True)

FAMILY_SETTINGS: Tuple[Setting, ...] = (
    # Dream's diffusion_generate.
    Setting(
        "alg",
        None,
        "Dream: origin | maskgit_plus | topk_margin | entropy (sampler 'dimple': origin | "
        "origin-ratio | autoregressive | maskgit_plus | entropy)",
        str,
        choice(_DREAM_ALGS + DIMPLE_ONLY_ALGS, " for sampler 'dream' or 'dimple'"),
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
        modes=DIFFUSION_MODE,
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
