"""Block-diffusion decoding's settings and commit rules (SDAR, SDAR-MoE, LLaDA2.x): LLaDA2.x token
editing (what it may rewrite, max_post_steps, editing off), the editing modes that 2.0 / 2.1 / 2.2
checkpoints default to, LLaDA2.2's edit-control tokens, the sequential and entropy-bounded rules,
the block-length warning and bad settings."""

import json
import logging

import mlx.core as mx
import numpy as np
import pytest

from block_checks import family_fixture, run, tokens
from helpers import load_fixture
from mlx_dllm_models import load as load_checkpoint
from mlx_dllm_models.decoding.block import sequential_commit
from mlx_dllm_models.engine import (
    Layout,
    StepContext,
    StepEvent,
)
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.settings_fields import ResolvedSettings

family = family_fixture()


def test_sequential_commits_the_leftmost_masks():
    cand = mx.array([[False, True, True, False, True, True], [True, True, True, True, True, True]])
    conf = mx.array(np.linspace(0, 1, 12).reshape(2, 6).astype(np.float32))
    stats = type("S", (), {"confidence": conf})()
    ctx = StepContext(0, 2, mx.array([3, 2]), None, ResolvedSettings.from_dict({}), None)
    got = sequential_commit(stats, cand, ctx)
    assert got.tolist() == [
        [False, True, True, False, True, False],
        [True, True, False, False, False, False],
    ]


# -------------------------------------------------------------------------------------- editing


def test_editing_rewrites_tokens_and_is_bounded_by_max_post_steps(family):
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    _, ids, dec = stream_events(
        model, tok, [tokens(7, seed=11)], max_tokens=25, editing_threshold=0.0, max_post_steps=3
    )
    before, edits, post_steps = None, 0, 0
    for event in dec.run(ids):
        if isinstance(event, StepEvent):
            now = event.canvas[0]
            if before is not None:
                edits += sum(a != b and a != mask for a, b in zip(before, now))
                post_steps += mask not in before
            before = now
    assert edits > 0
    assert post_steps == 3  # one block (25 tokens in columns 7..32): bounded by max_post_steps


def test_editing_never_touches_prompt_or_padding(family):
    """Row 0 is left-padded by a whole block and its prompt tail shares the second block with
    row 1's generated tokens: only decoded positions may be edited (those of the last block past
    max_tokens included, as in the reference, which edits the whole block but its prompt)."""
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    prompts = [tokens(7, seed=11), tokens(20, seed=12)]
    s, ids, dec = stream_events(
        model, tok, prompts, max_tokens=25, editing_threshold=0.0, max_post_steps=3
    )
    layout = Layout(ids, 25, s.block_length, True, mask)
    assert layout.pads == [32, 0] and layout.blocks() == [(20, 32), (32, 64)]
    seen = []

    class Watch(dec.backend_cls):
        def block_logits(self, x, start, stop):
            seen.append(np.array(x))  # the engine writes x in place
            return super().block_logits(x, start, stop)

    dec.backend_cls = Watch
    list(dec.run(ids))
    edits = 0
    initial, fixed = np.array(layout.tokens), ~np.array(layout.decoded)
    # Row 1's last block has positions past max_tokens (45..63): decoded, never returned.
    assert (np.array(layout.decoded) & ~np.array(layout.generated)).any(axis=1).tolist() == [
        False,
        True,
    ]
    for x in seen:
        n = x.shape[0]  # row 1 can only leave the batch first
        assert (x[fixed[:n]] == initial[:n][fixed[:n]]).all()
    for prev, x in zip(seen, seen[1:]):
        if prev.shape == x.shape:
            edits += ((prev != x) & (prev != mask)).sum()
    assert edits > 0, (
        "editing_threshold=0 never edited: the test could not see an unprotected position"
    )


def test_editing_off_never_changes_a_committed_token(family):
    _, model, tok = family("llada2_moe")
    mask = model.diffusion_spec.mask_token_id
    _, ids, dec = stream_events(model, tok, [tokens(7, 11)], max_tokens=25, threshold=0.7)
    before = None
    for event in dec.run(ids):
        if isinstance(event, StepEvent):
            now = event.canvas[0]
            if before is not None:
                assert all(a == b for a, b in zip(before, now) if a != mask)
            before = now


# ---------------------------------------------------------------------------- settings, errors


def test_editing_settings_for_a_family_without_editing(family):
    _, model, tok = family("sdar")
    for setting in ("editing_threshold", "max_post_steps"):
        with pytest.raises(SettingsError, match=f"unknown setting.*{setting} for the sdar family"):
            run(model, tok, [[1, 2, 3]], max_tokens=4, **{setting: 0.5})


def test_bad_editing_settings(family):
    _, model, tok = family("llada2_moe")
    with pytest.raises(
        SettingsError, match="max_post_steps only acts when editing_threshold is set"
    ):
        run(model, tok, [[1, 2, 3]], max_tokens=4, max_post_steps=4)
    with pytest.raises(SettingsError, match=r"editing_threshold must be in \[0, 1\]"):
        run(model, tok, [[1, 2, 3]], max_tokens=4, editing_threshold=1.5)
    with pytest.raises(SettingsError, match="max_post_steps must be an integer >= 0"):
        run(model, tok, [[1, 2, 3]], max_tokens=4, editing_threshold=0.9, max_post_steps=-1)


def test_untrained_block_length_is_allowed_and_logged_once(family, caplog):
    from mlx_dllm_models.engine import masked as engine

    _, model, tok = family("sdar")
    engine._WARNED_BLOCK_LENGTHS.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_dllm_models.engine"):
        run(model, tok, [[1, 2, 3]], max_tokens=4)  # the trained block size: silent
        assert not caplog.records
        for _ in range(2):
            run(model, tok, [[1, 2, 3]], max_tokens=8, block_length=8, steps=8)
    warnings = [
        r
        for r in caplog.records
        if "block_length=8 differs from the block size 4" in r.getMessage()
    ]
    assert len(warnings) == 1


def test_llada22_edit_control_tokens_are_never_proposed(family, tmp_path):
    """LLaDA2.2 decodes with substitution edits only: its DELETE / SPLIT tokens (insert/delete
    editing, out of scope) are never proposed, whether as a fill or as an edit."""
    import json
    import shutil
    from collections import Counter

    path, model, tok = family("llada2_moe")
    kw = dict(max_tokens=64, threshold=0.7, editing_threshold=0.6, max_post_steps=4)
    prompts = [tokens(9, 5), tokens(20, 6)]
    plain, _, _ = run(model, tok, prompts, **kw)
    common = [t for t, _ in Counter(t for row in plain for t in row).most_common(2)]
    assert len(common) == 2, "the fixture's output is too uniform for this test"

    v22 = tmp_path / "llada22"
    shutil.copytree(path, v22)
    cfg = json.loads((v22 / "config.json").read_text())
    cfg.update(delete_token_id=common[0], split_token_id=common[1])
    (v22 / "config.json").write_text(json.dumps(cfg))
    model22, tok22 = load_fixture(v22)
    assert set(model22.diffusion_spec.suppressed_token_ids) == set(common)
    out, _, decoder = run(model22, tok22, prompts, **kw)
    assert not set(common) & {t for row in out for t in row}
    assert all(len(row) > 0 for row in out)


# ------------------------------------------------------------------- LLaDA2.x editing modes

# A stand-in for LLaDA2.1's remote code: the signature of LLaDA2MoeModelLM.generate in
# LLaDA2.1-mini's modeling_llada2_moe.py (2.0's lacks editing_threshold, max_post_steps,
# num_to_transfer). Parsed by the loader, never run.
LLADA21_REMOTE_CODE = """
class LLaDA2MoeModelLM:
    def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048,
                 top_p=None, top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95,
                 editing_threshold=0.9, max_post_steps=16, eos_id=156892, mask_id=156895,
                 num_to_transfer=1):
        raise NotImplementedError
"""
LLADA20_REMOTE_CODE = LLADA21_REMOTE_CODE.replace(
    "threshold=0.95,\n                 editing_threshold=0.9, max_post_steps=16,", "threshold=0.95,"
).replace(",\n                 num_to_transfer=1", "")


def _llada2_with_remote_code(path, tmp_path, code, name):
    import shutil

    copy = tmp_path / name
    shutil.copytree(path, copy)
    (copy / "modeling_llada2_moe.py").write_text(code)
    return load_checkpoint(copy)  # the package's loader reads the remote code's signature


def test_llada21_checkpoints_default_to_quality_mode(family, tmp_path):
    """2.0 and 2.1 checkpoints have the same config and tokenizer files; the remote code's generate
    tells them apart. 2.1 decodes in the model card's Quality Mode (threshold 0.7, editing 0.5,
    max_post_steps 16), 2.0 as its generate (0.95, no editing)."""
    path, model, tok = family("llada2_moe")
    assert "editing_threshold" not in LLADA20_REMOTE_CODE
    model20, tok20 = _llada2_with_remote_code(path, tmp_path, LLADA20_REMOTE_CODE, "v20")
    model21, tok21 = _llada2_with_remote_code(path, tmp_path, LLADA21_REMOTE_CODE, "v21")
    for m, t, mode, values in (
        (model, tok, "off", (0.95, None)),  # no remote code: 2.0's defaults
        (model20, tok20, "off", (0.95, None)),
        (model21, tok21, "quality", (0.7, 0.5)),
    ):
        s, _, _ = stream_events(m, t, [[1, 2, 3]], max_tokens=4)
        assert s.editing_mode == mode
        assert (s.threshold, s.editing_threshold, s.max_post_steps) == (*values, 16)
    prompts = [tokens(7, 11), tokens(20, 12)]
    got, _, dec = run(model21, tok21, prompts, max_tokens=40)
    quality = dict(threshold=0.7, editing_threshold=0.5, max_post_steps=16)
    assert got == run(model, tok, prompts, max_tokens=40, **quality)[0]
    assert got != run(model, tok, prompts, max_tokens=40)[0], "the fixture cannot tell them apart"


def test_editing_modes_and_explicit_settings(family):
    _, model, tok = family("llada2_moe")

    def resolved(**kw):
        return stream_events(model, tok, [[1, 2, 3]], max_tokens=4, **kw)[0]

    s = resolved(editing_mode="speed")
    assert (s.threshold, s.editing_threshold, s.max_post_steps) == (0.5, 0.0, 16)
    s = resolved(editing_mode="quality", threshold=0.8, max_post_steps=4)
    assert (s.threshold, s.editing_threshold, s.max_post_steps) == (0.8, 0.5, 4)
    s = resolved(editing_mode="off")
    assert (s.threshold, s.editing_threshold) == (0.95, None)
    with pytest.raises(SettingsError, match="unknown editing_mode 'fast'.*quality, speed, off"):
        resolved(editing_mode="fast")


def test_llada22_checkpoints_default_to_quality_mode(family, tmp_path):
    """LLaDA2.2 is known from its config.json (its edit-control token ids)."""
    import shutil

    path, _, _ = family("llada2_moe")
    v22 = tmp_path / "llada22_mode"
    shutil.copytree(path, v22)
    cfg = json.loads((v22 / "config.json").read_text())
    cfg.update(delete_token_id=250, split_token_id=251)
    (v22 / "config.json").write_text(json.dumps(cfg))
    model22, tok22 = load_fixture(v22)
    s, _, _ = stream_events(model22, tok22, [[1, 2, 3]], max_tokens=4)
    assert (s.editing_mode, s.threshold, s.editing_threshold) == ("quality", 0.7, 0.5)


def test_entropy_bounded_settings(family):
    _, model, tok = family("sdar")

    def resolved(**kw):
        return stream_events(model, tok, [[1, 2, 3]], max_tokens=4, **kw)[0]

    assert resolved(sampler="entropy_bounded").eb_threshold == 0.35  # generate.py's default
    assert resolved().threshold == 0.9 and resolved().eb_threshold is None
    with pytest.raises(
        SettingsError, match="eb_threshold only acts with sampler='entropy_bounded'"
    ):
        resolved(eb_threshold=0.5)
    with pytest.raises(SettingsError, match="eb_threshold must be a number > 0"):
        resolved(sampler="entropy_bounded", eb_threshold=0)
    _, model2, tok2 = family("llada2_moe")
    with pytest.raises(SettingsError, match="unknown sampler 'entropy_bounded'"):
        stream_events(model2, tok2, [[1, 2, 3]], max_tokens=4, sampler="entropy_bounded")
