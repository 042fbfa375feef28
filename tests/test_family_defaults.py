"""Each family's effective default settings are its documented ones, and have one home.

A family's defaults live in its spec (`DiffusionSpec.defaults`, with `sampler_defaults` and
`presets`; some read from config.json), over the package defaults of the settings table's shared
rows; the table's family rows hold none. Here, for every family, on a model built from a real
config.json (tests/data) or from a fixture's config (tests/fixtures), without weights:

* `resolve_settings(spec, {}, {})` equals the defaults the family documents: the reference's
  (cited per value) as README's family table states them;
* the documentation quotes those numbers (the phrases below are looked up in each family's page and
  in the settings guide's rows), so that a changed
  default and a stale README cannot both pass;
* a family row's default is None, a row's default is read (not overwritten), and every default a
  spec states is a setting of its family (a misspelt one would otherwise do nothing).
"""

import dataclasses
from pathlib import Path

import pytest

from family_cases import CONFIGS, case_spec
from fixtures import diffusion_gemma, nemotron
from mlx_dllm_models.settings import SETTINGS, SettingsError, family_settings, resolve_settings

ROOT = Path(__file__).resolve().parents[1]


# What the checkpoint itself implies beyond its config.json (LLaDA2.1: the remote code's generate
# takes editing_threshold; spec.remote_generate_settings).
CHECKPOINT = {"llada2.1": lambda spec: spec.remote_generate_settings["editing_threshold"]}

# The package defaults of the shared rows, where a family keeps them.
SHARED = dict(
    max_tokens=128,
    block_length=32,
    steps=32,
    sampler="quota",
    threshold=0.9,
    factor=1.0,
    entropy_bound=0.1,
    temperature=0.0,
    top_p=None,
    top_k=None,
    seed=0,
    cache="auto",
    logprobs=None,
)
# LLaDA generate.py: generate(steps=128, gen_length=128, block_length=32 (README), temperature=0.,
# cfg_scale=0., remasking='low_confidence'), logits_eos_inf / confidence_eos_eot_inf off; steps
# per block here (128 over 4 blocks = 32).
# The d3llm sampler's settings are unset under the other samplers (its recipe: test_d3llm.py).
D3LLM_UNSET = dict.fromkeys(
    ("block_size", "block_add_threshold", "decoded_token_threshold", "early_stop")
)
# The lavida sampler's schedule settings (LaViDa's generate) are unset under the other samplers.
LLADA = dict(
    SHARED,
    cfg_scale=0.0,
    logits_eos_inf=False,
    confidence_eos_eot_inf=False,
    schedule=None,
    schedule_shift=None,
    **D3LLM_UNSET,
)
# SDAR: block 4 = config.block_size (trained), denoising_steps = block, greedy (README evaluation),
# low_confidence_dynamic at 0.9 (README's JetEngine / LMDeploy examples); eb_threshold only with
# the entropy_bounded sampler.
SDAR = dict(SHARED, block_length=4, steps=4, sampler="threshold", eb_threshold=None)
# LLaDA2.0's generate: threshold 0.95 (strict >), block 32, steps 32, temperature 0, no editing.
LLADA2_OFF = dict(
    SHARED,
    sampler="threshold",
    threshold=0.95,
    editing_mode="off",
    editing_threshold=None,
    max_post_steps=16,
)
# LLaDA2.1 model card, Best Practices: Quality Mode threshold 0.7, editing_threshold 0.5,
# max_post_steps 16.
LLADA2_QUALITY = dict(LLADA2_OFF, editing_mode="quality", threshold=0.7, editing_threshold=0.5)

DOCUMENTED = {
    "llada": LLADA,
    "llada_moe": LLADA,
    # Dream's README recipe: diffusion_generate(max_new_tokens=512, steps=512, temperature=0.2,
    # top_p=0.95, alg="entropy", alg_temp=0.), eps 1e-3 (generation_config); steps = max_tokens:
    # the whole canvas is one block.
    "dream": dict(
        SHARED,
        block_length=128,
        steps=128,
        sampler="dream",
        temperature=0.2,
        top_p=0.95,
        alg="entropy",
        alg_temp=0.0,
        eps=1e-3,
        alg_p_threshold=None,  # Dimple's sampler's (a Dream-family checkpoint), unset
        **D3LLM_UNSET,
    ),
    "sdar": SDAR,
    "sdar_moe": SDAR,
    "llada2.0": LLADA2_OFF,
    "llada2.1": LLADA2_QUALITY,
    "llada2.2": LLADA2_QUALITY,
    # Nemotron-Labs-Diffusion: confidence-thresholded unmasking at 0.9 (NVlabs README, vLLM,
    # mlx-vlm), block = config.block_size (the fixture's 8), generate_diffusion's
    # causal_context=True, temperature 0, diffusion mode.
    "nemotron": dict(
        SHARED,
        block_length=nemotron.BLOCK_SIZE,
        steps=nemotron.BLOCK_SIZE,
        sampler="threshold",
        mode="diffusion",
        draft_threshold=None,
        causal_context=True,
        max_thinking_tokens=None,
        end_think_token_id=None,
    ),
    # DiffusionGemma: transformers' DiffusionGemmaGenerationConfig defaults and the official
    # generation_config.json (max_new_tokens 256, max_denoising_steps 48, entropy_bound 0.1,
    # t_min 0.4, t_max 0.8, stability_threshold 1, confidence_threshold 0.005); every canvas the
    # trained canvas_length (config.json's; the fixture's 16).
    "diffusion_gemma": dict(
        SHARED,
        max_tokens=256,
        sampler="entropy",
        max_denoising_steps=48,
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        min_canvas_length=diffusion_gemma.CANVAS_LENGTH,
        max_canvas_length=diffusion_gemma.CANVAS_LENGTH,
    ),
}


def _defaults(case, **explicit):
    spec = case_spec(case)
    checkpoint = CHECKPOINT[case](spec) if case in CHECKPOINT else {}
    return resolve_settings(spec, explicit, checkpoint)


@pytest.mark.parametrize("case", sorted(DOCUMENTED))
def test_effective_defaults_are_the_documented_ones(case):
    assert _defaults(case).as_dict() == DOCUMENTED[case]


def test_every_family_has_a_documented_case():
    families = {case_spec(case).family for case in DOCUMENTED}
    assert families == {
        "llada",
        "dream",
        "sdar",
        "llada2",
        "nemotron",
        "diffusion_gemma",
    }
    assert set(DOCUMENTED) == set(CONFIGS)


SPEED = '`editing_mode="speed"`: 0.5 / 0.0'

# README's rows -> (phrase it quotes, case, explicit settings, setting, the value the phrase says).
README_QUOTES = {
    "| Dream 7B": [
        ('`alg="entropy"`', "dream", {}, "alg", "entropy"),
        ("`alg_temp=0`", "dream", {}, "alg_temp", 0),
        ("`temperature=0.2`", "dream", {}, "temperature", 0.2),
        ("`top_p=0.95`", "dream", {}, "top_p", 0.95),
        ("steps = `max_tokens`", "dream", {"max_tokens": 40}, "steps", 40),
    ],
    "| SDAR ": [
        ("`threshold` 0.9", "sdar", {}, "threshold", 0.9),
        ("block 4 = `config.block_size`", "sdar", {}, "block_length", 4),
        ("4 steps", "sdar", {}, "steps", 4),
        ("greedy", "sdar", {}, "temperature", 0.0),
        ("`eb_threshold` 0.35", "sdar", {"sampler": "entropy_bounded"}, "eb_threshold", 0.35),
    ],
    "| LLaDA2.0 ": [
        ('`editing_mode="quality"` for 2.1 / 2.2', "llada2.1", {}, "editing_mode", "quality"),
        ('`editing_mode="quality"` for 2.1 / 2.2', "llada2.2", {}, "editing_mode", "quality"),
        ("threshold 0.7", "llada2.2", {}, "threshold", 0.7),
        ("editing_threshold 0.5", "llada2.2", {}, "editing_threshold", 0.5),
        ("max_post_steps 16", "llada2.2", {}, "max_post_steps", 16),
        (SPEED, "llada2.2", {"editing_mode": "speed"}, "threshold", 0.5),
        (SPEED, "llada2.2", {"editing_mode": "speed"}, "editing_threshold", 0.0),
        ('`"off"` for 2.0', "llada2.0", {}, "editing_mode", "off"),
        ("0.95, no editing", "llada2.0", {}, "threshold", 0.95),
        ("0.95, no editing", "llada2.0", {}, "editing_threshold", None),
    ],
    "| Nemotron-Labs-Diffusion ": [
        ("`threshold` 0.9", "nemotron", {}, "threshold", 0.9),
        ("block = `config.block_size`", "nemotron", {}, "block_length", nemotron.BLOCK_SIZE),
    ],
    "| DiffusionGemma ": [
        ("`entropy` (entropy bound, default)", "diffusion_gemma", {}, "sampler", "entropy"),
        (
            "every canvas is the trained `canvas_length`",
            "diffusion_gemma",
            {},
            "min_canvas_length",
            diffusion_gemma.CANVAS_LENGTH,
        ),
    ],
    "| `cfg_scale`": [
        ("`cfg_scale` (default 0: off)", "llada", {}, "cfg_scale", 0),
        ("`cfg_scale` (default 0: off)", "llada_moe", {}, "cfg_scale", 0),
    ],
    "| `causal_context`": [
        ("`causal_context` (default true", "nemotron", {}, "causal_context", True),
    ],
}


# Where each row's text lives now: a family's page, or a row of the settings guide's tables.
DOC_PAGES = {
    "| Dream 7B": "families/dream.md",
    "| SDAR ": "families/sdar.md",
    "| LLaDA2.0 ": "families/llada2.md",
    "| Nemotron-Labs-Diffusion ": "families/nemotron.md",
    "| DiffusionGemma ": "families/diffusion-gemma.md",
    "| `cfg_scale`": "guide/settings.md",
    "| `causal_context`": "guide/settings.md",
}


def _readme_row(start):
    text = (ROOT / "docs" / DOC_PAGES[start]).read_text()
    if not start.startswith("| `"):
        return text  # a family page: all of it is that family's
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert len(rows) == 1, f"{DOC_PAGES[start]} has {len(rows)} rows starting {start!r}"
    return rows[0]


@pytest.mark.parametrize("row", sorted(README_QUOTES))
def test_readme_quotes_the_effective_defaults(row):
    text = _readme_row(row)
    for phrase, case, explicit, name, value in README_QUOTES[row]:
        assert phrase in text, f"README's {row!r} row no longer says {phrase!r}"
        got = getattr(_defaults(case, **explicit), name)
        assert got == value, (row, phrase, case, name, got)


def test_family_rows_hold_no_default():
    """A family setting's default is its spec's: a number in the table's row would be a second
    copy (it used to be one, overwritten with None and never read)."""
    rows = [s for s in SETTINGS if s.families]
    assert rows
    held = {s.name: s.default for s in rows if s.default is not None}
    assert not held, f"family rows with a default (state it in the family's spec): {held}"


def test_a_row_default_is_read_not_overwritten():
    """Resolution reads every row's default under the spec's: a value put in a family row takes
    effect where the spec does not set one, instead of silently doing nothing; and a spec that
    leaves a required setting without a default is refused, not run with None."""
    spec = case_spec("nemotron")
    bare = dataclasses.replace(
        spec, defaults={k: v for k, v in spec.defaults.items() if k != "causal_context"}
    )
    with pytest.raises(SettingsError, match="causal_context must be true or false, got None"):
        resolve_settings(bare, {}, {})
    rows = tuple(
        dataclasses.replace(row, default=False) if row.name == "causal_context" else row
        for row in spec.settings
    )
    bare, spec = (dataclasses.replace(s, settings=rows) for s in (bare, spec))
    assert resolve_settings(bare, {}, {}).causal_context is False
    assert resolve_settings(spec, {}, {}).causal_context is True  # the spec's, over the row


@pytest.mark.parametrize("case", sorted(DOCUMENTED))
def test_every_default_a_spec_states_is_a_setting_of_its_family(case):
    spec = case_spec(case)
    known = {s.name for s in SETTINGS if not s.families} | set(family_settings(spec.family))
    stated = set(spec.defaults)
    for values in spec.sampler_defaults.values():
        stated |= set(values)
    for setting, modes in spec.presets.items():
        stated.add(setting)
        for values in modes.values():
            stated |= set(values)
    assert stated <= known, f"{spec.family}: defaults of no setting: {sorted(stated - known)}"
