"""LLaDA2.2's insert/delete editing: the engine's decode of the 2.2 fixture (block routing, loaded
through plain mlx-lm) against the torch transcription of the checkpoint's `_joint_decode_block`
(tests/reference/llada22_joint_decode.py) at the reference's defaults, with the head pushed toward
DELETE / SPLIT so that both are proposed and consumed; the pure edit rule against the
transcription's list scan; batch rows against single runs."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from fixtures import build_once
from fixtures import llada2 as llada2_fixture
from helpers import load_fixture
from mlx_dllm_models.decoding.levenshtein import apply_edit_ops
from mlx_dllm_models.engine import BlockEvent, StepEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import block_causal_mask
from reference.llada22_joint_decode import apply_edits, llada22_generate

MASK, DELETE, SPLIT = llada2_fixture.MASK, llada2_fixture.DELETE, llada2_fixture.SPLIT
BLOCK = llada2_fixture.BLOCK_LENGTH


@pytest.fixture(scope="module")
def loaded(fixture_dir):
    path = build_once(fixture_dir / "llada22", llada2_fixture.build_22)
    model, tok = load_fixture(path)
    # Push the head toward the edit tokens (a copy of the most common rows, raised), so that
    # the tiny model proposes DELETE and SPLIT at some positions and not at all.
    head = model.lm_head.weight
    rng = np.random.default_rng(0)
    rows = mx.array(rng.standard_normal((2, head.shape[1])).astype(np.float32))
    head[DELETE] = head[DELETE] * 0 + 3.0 * rows[0]
    head[SPLIT] = head[SPLIT] * 0 + 3.0 * rows[1]
    model.lm_head.weight = head
    return model, tok


def torch_forward(model):
    def forward(ids, keep):
        logits = model(mx.array(ids.numpy()), mask=block_causal_mask(ids.shape[1], BLOCK))
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    return forward


def run(model, tok, prompts, **kw):
    """Each row's tokens, the per-step canvases of the first row, and the decoder; `stopped`:
    whether the first row ended at an EOS (the engine then decodes no further block, where the
    reference decodes every block of max_tokens)."""
    _, ids, decoder = stream_events(model, tok, prompts, **kw)
    out, canvases = [[] for _ in ids], []
    decoder.stopped = False
    for event in decoder.run(ids):
        if isinstance(event, StepEvent):
            canvases.append(np.array(event.generated)[0].tolist())
        if isinstance(event, BlockEvent):
            for row, toks, hit in zip(event.rows, event.tokens, event.eos):
                out[row].extend(toks)
                decoder.stopped = decoder.stopped or (row == 0 and bool(hit))
    return out, canvases, decoder


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_edit_rule_matches_transcription(seed):
    """Rows whose generated positions are a suffix (a first block's prompt tail stays in place) or
    interleaved with prompt tokens (masks inside a prompt): the generated positions, read as one
    sequence, are edited as the transcription's list scan edits it."""
    rng = np.random.default_rng(seed)
    choices = [1, 2, 3, 4, MASK, DELETE, SPLIT]
    rows = [rng.choice(choices, 12).tolist() for _ in range(4)]
    olds = [rng.choice([1, 2, 3, MASK], 12).tolist() for _ in range(4)]
    flags = [rng.random(12) < 0.5 for _ in range(4)]
    gen = [[i >= f for i in range(12)] for f in (0, 3, 7)] + [(rng.random(12) < 0.6).tolist()]
    got, got_flags = apply_edit_ops(
        mx.array(rows),
        mx.array(olds),
        mx.array(np.array(flags)),
        mx.array(gen),
        MASK,
        DELETE,
        SPLIT,
    )
    for r, g in enumerate(gen):
        at = [i for i in range(12) if g[i]]
        want, want_flags = apply_edits(
            [rows[r][i] for i in at],
            [olds[r][i] for i in at],
            [flags[r][i] for i in at],
            MASK,
            DELETE,
            SPLIT,
        )
        expected = list(rows[r])
        for i, token in zip(at, want):
            expected[i] = token
        assert got.tolist()[r] == expected
        assert [got_flags.tolist()[r][i] for i in at] == want_flags


def reference(model, tok, ids, gen, **kw):
    spec = model.diffusion_spec
    ids_t = torch.tensor([ids])
    ids_kw = dict(mask_id=MASK, delete_id=DELETE, split_id=SPLIT, eos_id=spec.eos_token_ids[0])
    return llada22_generate(torch_forward(model), ids_t, gen, **ids_kw, **kw)


def without_eos(ids, eos_id):
    ids = [int(t) for t in ids]
    return ids[:-1] if ids and ids[-1] == eos_id else ids


# (prompt length, max_tokens): ending on a block edge (the reference decodes whole blocks).
CASES = [(7, 57), (40, 24), (3, 29)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings,edits",
    [
        ({}, True),  # generate's defaults
        ({"steps": 8, "threshold": 0.7, "max_post_steps": 3}, True),
        # The final round is the step that fills the last original mask (no edit happens here).
        ({"steps": 8, "threshold": 0.9, "max_post_steps": 0}, False),
    ],
)
def test_decode_matches_transcription_with_deletes_and_inserts(loaded, settings, edits):
    """At the reference's defaults (block 32, steps 32, threshold 0.5, editing_threshold 0.0,
    max_post_steps 16) and others: the canvas after every step, the tokens and the forwards."""
    model, tok = loaded
    eos = model.diffusion_spec.eos_token_ids[0]
    deletes = splits = stops = 0
    for n, gen in CASES:
        p = prompt(n, n)
        want, forwards, trace = reference(model, tok, p, gen, **settings)
        assert trace["repeats"] == 0, (
            "the reference's random anti-loop would fire: pick another case"
        )
        (got,), canvases, dec = run(model, tok, [p], max_tokens=gen, **settings)
        assert got == without_eos(want, eos)
        forwards_run = dec.nfe - dec.backend.prefill_forwards
        assert canvases == [c[:gen] for c in trace["canvas"][:forwards_run]]
        if not dec.stopped:
            assert forwards_run == forwards
        else:  # the blocks past its EOS, which the reference decodes and the engine does not
            assert forwards_run <= forwards
        deletes, splits = deletes + trace["deletes"], splits + trace["splits"]
        stops += dec.stopped
    assert stops < len(CASES)  # a case decodes every block as the reference does
    if edits:
        assert deletes > 0 and splits > 0  # both edits were proposed and consumed


@pytest.mark.slow
def test_batch_rows_equal_single_runs(loaded, monkeypatch):
    """A row's edits shift tokens inside its own block only: rows keep their length, and each row
    of a batch (prompts of different lengths, left-padded) decodes as it does alone."""
    from mlx_dllm_models.engine import editing

    consumed = []

    def counted(block, old, original, gen, mask_id, delete_id, split_id):
        edit = gen & ((block == delete_id) | (block == split_id))
        consumed.append(edit.sum().item())
        return apply_edit_ops(block, old, original, gen, mask_id, delete_id, split_id)

    monkeypatch.setattr(editing, "apply_edit_ops", counted)
    model, tok = loaded
    prompts = [prompt(n, n) for n, _ in CASES]
    results = []
    for cache in ("prefix", "none"):  # the prefix cache's forwards and full recompute's agree
        kw = dict(max_tokens=30, cache=cache)
        batch, _, _ = run(model, tok, prompts, **kw)
        assert batch == [run(model, tok, [p], **kw)[0][0] for p in prompts]
        results.append(batch)
    assert results[0] == results[1]
    assert sum(consumed) > 0  # the batches' rows did delete or insert


def test_editing_off_never_proposes_edit_tokens(loaded):
    """editing_mode off: 2.0's decoding, DELETE / SPLIT suppressed."""
    model, tok = loaded
    (got,), _, _ = run(model, tok, [prompt(7, 7)], max_tokens=25, editing_mode="off")
    assert got and DELETE not in got and SPLIT not in got


def test_loads_with_the_reference_defaults(loaded, fixture_dir):
    """A 2.2 config (expert_capacity, DELETE / SPLIT ids) loads, through plain mlx-lm (`loaded`)
    and the package's loader, and decodes at generate's defaults with insert/delete edits on."""
    from mlx_dllm_models import load

    model, _ = load(build_once(fixture_dir / "llada22", llada2_fixture.build_22))
    assert model.args.expert_capacity == llada2_fixture.EXPERT_CAPACITY
    assert model.diffusion_spec.edit_token_ids == (DELETE, SPLIT)
    s, _, _ = stream_events(*loaded, [[1, 2, 3]], max_tokens=4)
    got = [
        getattr(s, k) for k in ("editing_mode", "threshold", "editing_threshold", "max_post_steps")
    ]
    assert got == ["speed", 0.5, 0.0, 16]
    assert (s.block_length, s.steps) == (BLOCK, BLOCK)


def test_grammar_constraints_are_refused_with_edits_on(loaded):
    from mlx_dllm_models.generate import batch_generate_diffusion
    from mlx_dllm_models.settings import SettingsError

    model, tok = loaded
    with pytest.raises(SettingsError, match="insert/delete edits move"):
        batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=4, regex="[a-z]+")
    out = batch_generate_diffusion(
        model, tok, [[40, 41]], max_tokens=4, regex="[a-z]+", editing_mode="off"
    )
    assert out.tokens[0]
