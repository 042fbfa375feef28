"""Half-precision and quantized checkpoints on MLX's CPU backend (models/cpu_layers.py): every
family computes what the float32 upcast of its weights computes, through float32 matmuls, and the
path is taken on the CPU only.

Forms of a checkpoint: "bf16" (as published), "q4" / "q8" (mlx-lm's quantization of the bf16
checkpoint: bfloat16 scales), and "q4_f32" (quantized from float32: float32 scales, so today's
kernels compute in float32 too and the two paths can be compared directly). Today's bfloat16 path
rounds every activation to bfloat16 (and `quantized_matmul` accumulates in it): on these fixtures
its logits sit 1e-2 to 8e-1 (of the largest) from the float32 upcast's, which the new path matches
to float32 rounding."""

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.models.switch_layers import SwitchGLU

from checkpoint_forms import narrow
from fixtures import all_checkpoints, build_once
from helpers import parity
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.models import cpu_layers
from mlx_dllm_models.models.cpu_layers import restore_layers, use_float32_matmuls

NAMES = sorted(all_checkpoints())
# Decoders that feed their own outputs back as soft embeddings until a block settles: on a random
# fixture, which never settles, a quantized form's float32 rounding (logits within 1e-5 relative of
# the upcast reference's) flips its tokens, so only its logits are compared (tests/test_dmax.py
# holds its loop to the reference on exact float32 weights).
FEEDS_BACK_ROUNDING = {"dmax"}
FORMS = ("bf16", "q4", "q8", "q4_f32")
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]

pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def ckpts(fixture_dir):
    return {n: build_once(fixture_dir / n, b) for n, b in all_checkpoints().items()}


def widen(model):
    """The float32 upcast: every floating tensor (weights, scales, biases) in float32."""

    def cast(_, v):
        return v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))
    return model


def tokens(model, tok):
    if model.diffusion_spec.family == "diffusion_gemma":
        kw = dict(max_denoising_steps=4, seed=1)
    else:
        kw = dict(temperature=0.0)
    out = []
    for r in stream_generate_diffusion(model, tok, PROMPT, max_tokens=16, **kw):
        out.extend(r.tokens)
    return out


def logits(model):
    ids = mx.array([PROMPT + [model.diffusion_spec.mask_token_id or 0] * 8])
    return np.array(model(ids).astype(mx.float32))


def cpu_classes(model):
    return [m for _, m in model.named_modules() if type(m) in cpu_layers.VARIANTS.values()]


def narrow_layers(model):
    """Layers of the swapped classes' parents that still hold narrow weights."""
    return [
        m
        for _, m in model.named_modules()
        if type(m) in cpu_layers.VARIANTS
        and ("scales" in m or m["weight"].dtype in (mx.bfloat16, mx.float16))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_family_computes_its_float32_upcast(ckpts, name, form):
    model, tok = load(ckpts[name])
    assert not cpu_classes(model)  # a float32 checkpoint: load swapped nothing
    narrow(model, form)
    today = (logits(model), tokens(model, tok)) if form == "q4_f32" else None
    assert use_float32_matmuls(model) > 0
    assert not narrow_layers(model)
    ours = logits(model)
    assert ours.dtype == np.float32

    reference = widen(narrow(load(ckpts[name])[0], form))
    ok, err = parity(ours, logits(reference))
    assert ok, (name, form, err)
    if name in FEEDS_BACK_ROUNDING:
        return  # its logits hold above; its tokens are not a float32-rounding-free comparison
    assert tokens(model, tok) == tokens(reference, tok)
    if today is not None:  # float32 activations both ways: today's kernels, the same numbers
        ok, err = parity(ours, today[0])
        assert ok, (name, form, err)
        assert tokens(model, tok) == today[1]


def _bf16_copy(src, dst):
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        arrays = mx.load(str(f))
        floating = {k: v.astype(mx.bfloat16) for k, v in arrays.items() if v.dtype == mx.float32}
        mx.save_safetensors(str(f), {**arrays, **floating}, metadata={"format": "mlx"})
    return dst


def test_load_takes_the_path_on_the_cpu_only(ckpts, tmp_path, monkeypatch):
    path = _bf16_copy(ckpts["llada"], tmp_path / "bf16")
    model, tok = load(path)
    assert cpu_classes(model) and not narrow_layers(model)
    ours = logits(model)
    assert ours.dtype == np.float32

    # Another device (Metal, CUDA): load swaps nothing, and a swapped layer runs its parent.
    monkeypatch.setattr(cpu_layers, "on_cpu", lambda: False)
    elsewhere, _ = load(path)
    assert not cpu_classes(elsewhere)
    assert model(mx.array([PROMPT])).dtype == mx.bfloat16  # the same instance, parents' forward
    assert use_float32_matmuls(elsewhere) == 0
    monkeypatch.undo()

    assert restore_layers(model) > 0 and not cpu_classes(model)
    assert model(mx.array([PROMPT])).dtype == mx.bfloat16


# ---------------------------------------------------------------------------------- layers


def _rel(a, b):
    a, b = np.array(a, np.float64), np.array(b.astype(mx.float32), np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def _dequantized(layer):
    return mx.dequantize(
        layer.weight,
        layer.scales.astype(mx.float32),
        layer.biases.astype(mx.float32),
        layer.group_size,
        layer.bits,
    )


@pytest.mark.parametrize("bits", [None, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_linear_and_table_widen_exactly(bits, group_size, monkeypatch):
    """Linear, QuantizedLinear (the unpacked pieces for 2 / 4 / 8 bits, mx.dequantize for 3 / 6),
    and an embedding as table, as head (widened a slice of rows at a time) and as self-conditioning
    read-back (p @ E)."""
    mx.random.seed(0)
    lin = nn.Linear(256, 96, bias=True)
    lin.set_dtype(mx.bfloat16)
    table = nn.Embedding(300, 64)
    table.set_dtype(mx.bfloat16)
    if bits:
        lin = nn.QuantizedLinear.from_linear(lin, group_size, bits)
        table = nn.QuantizedEmbedding.from_embedding(table, group_size, bits)
        w, e = _dequantized(lin), _dequantized(table)
    else:
        w, e = lin.weight.astype(mx.float32), table.weight.astype(mx.float32)
    model = nn.Sequential(lin, table)
    assert use_float32_matmuls(model) == 2

    x = mx.random.normal((2, 5, 256))
    assert _rel(lin(x), x @ w.T + lin.bias.astype(mx.float32)) < 1e-5
    ids = mx.array([[1, 5, 299]])
    assert table(ids).dtype == mx.float32 and _rel(table(ids), e[ids]) == 0
    h, p = mx.random.normal((3, 64)), mx.softmax(mx.random.normal((2, 300)), axis=-1)
    for chunk in (1 << 26, 1000):  # whole, and 5 rows a slice (the LM head of a big vocabulary)
        monkeypatch.setattr(cpu_layers, "CHUNK_ELEMENTS", chunk)
        assert _rel(table.as_linear(h), h @ e.T) < 1e-5
        assert _rel(cpu_layers.rows_times(table, p), p @ e) < 1e-5


def _switch_glu(bits):
    """A bf16 (or quantized) SwitchGLU of 16 experts and its float32 upcast."""
    mx.random.seed(1)
    glu = SwitchGLU(64, 32, 16)
    glu.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(glu, 32, bits)
    reference = SwitchGLU(64, 32, 16)
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(glu, name)
        wide = _dequantized(layer) if bits else layer.weight.astype(mx.float32)
        getattr(reference, name).weight = wide
    return glu, reference


@pytest.mark.slow
@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("tokens, among", [(2, 16), (40, 16), (40, 10)])
def test_expert_gather_widens_exactly(bits, tokens, among):
    """SwitchGLU through gather_mm / gather_qmm, top-4 of 16 experts drawn from the first `among`:
    2 tokens (8 pairs, mlx-lm's unsorted gather), 40 tokens over all 16 experts (160 pairs, its
    sorted gather, every expert selected) and over 10 of them (more pairs than experts, fewer
    experts selected), and inside mx.compile."""
    glu, reference = _switch_glu(bits)
    x = mx.random.normal((1, tokens, 64))
    idx = mx.random.randint(0, among, (1, tokens, 4)).astype(mx.uint32)
    assert use_float32_matmuls(glu) == 3
    assert _rel(glu(x, idx), reference(x, idx)) < 1e-5
    # Inside mx.compile the indices cannot be read on the host: every expert widened.
    compiled = mx.compile(lambda x, idx: glu(x, idx))
    assert _rel(compiled(x, idx), reference(x, idx)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_gather_of_about_one_pair_an_expert_runs_gather_qmm(bits, monkeypatch):
    """2 tokens x top-4 over distinct experts (one pair an expert: a small block) go through
    MLX's gather_qmm, nothing widened; 40 tokens over 10 experts are widened. Both within
    float32 rounding of the float32 upcast."""
    glu, reference = _switch_glu(bits)
    use_float32_matmuls(glu)
    widened = []
    layer_pieces = cpu_layers._layer_pieces

    def record(layer, rows=None, experts=None):
        widened.append(layer)
        return layer_pieces(layer, rows, experts)

    monkeypatch.setattr(cpu_layers, "_layer_pieces", record)
    x = mx.random.normal((1, 2, 64))
    idx = mx.array([[[0, 1, 2, 3], [4, 5, 6, 7]]], dtype=mx.uint32)
    y = glu(x, idx)
    assert y.dtype == mx.float32 and not widened
    assert _rel(y, reference(x, idx)) < 1e-5
    many = mx.random.randint(0, 10, (1, 40, 4)).astype(mx.uint32)
    x = mx.random.normal((1, 40, 64))
    assert _rel(glu(x, many), reference(x, many)) < 1e-5 and len(widened) == 3


@pytest.mark.parametrize("bits", [None, 4])
def test_expert_gather_widens_only_the_selected_experts(bits, monkeypatch):
    """160 pairs over 10 of 16 experts: each projection widens those 10 experts, once each (not
    every expert because the pairs outnumber the experts, nor one copy per pair)."""
    glu, _ = _switch_glu(bits)
    use_float32_matmuls(glu)
    idx = mx.random.randint(0, 10, (1, 40, 4)).astype(mx.uint32)
    assert len(np.unique(np.array(idx))) == 10
    widened = []
    layer_pieces = cpu_layers._layer_pieces

    def record(layer, rows=None, experts=None):
        widened.append(None if experts is None else sorted(np.array(experts).tolist()))
        return layer_pieces(layer, rows, experts)

    monkeypatch.setattr(cpu_layers, "_layer_pieces", record)
    mx.eval(glu(mx.random.normal((1, 40, 64)), idx))
    assert widened == [sorted(np.unique(np.array(idx)).tolist())] * 3


@pytest.mark.parametrize("bits", [None, 4])
def test_many_pairs_an_expert_multiply_expert_by_expert(bits, monkeypatch):
    """160 sorted pairs over 10 experts (16 an expert, as in a prefill or a full-recompute
    forward) run one BLAS matmul per expert and no gather_mm (MLX's CPU gather_mm multiplies
    pair by pair: 3.5-5.4x slower at 72 pairs an expert), within float32 rounding of the upcast;
    80 sorted pairs at 5 an expert keep gather_mm."""
    glu, reference = _switch_glu(bits)
    use_float32_matmuls(glu)
    x = mx.random.normal((1, 40, 64))
    idx = mx.random.randint(0, 10, (1, 40, 4)).astype(mx.uint32)
    few = mx.random.randint(0, 16, (1, 20, 4)).astype(mx.uint32)
    want = reference(x, idx)
    mx.eval(want, few)
    calls = []
    gather_mm = mx.gather_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("sorted_indices"))
        return gather_mm(*args, **kwargs)

    monkeypatch.setattr(mx, "gather_mm", spy)
    assert _rel(glu(x, idx), want) < 1e-5 and calls == []
    mx.eval(glu(x[:, :20], few))
    assert calls and all(calls)


def test_widened_weights_do_not_accumulate():
    """A forward holds the widened weights of the layers MLX has scheduled ahead (its CPU
    scheduler runs about a hundred ops ahead of the computation: some 25 layers of this bare chain
    of matmuls, a few layers of a transformer), not the model's: the peak does not grow with the
    depth."""
    depth, width = 96, 512
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    model.set_dtype(mx.bfloat16)
    use_float32_matmuls(model)
    x = mx.random.normal((4, width))
    mx.eval(x, model.parameters(), model(x))
    widened = 4 * width * width
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(x))
    assert mx.get_peak_memory() - before < 40 * widened  # the upcast: 96 of them


# ------------------------------------------------------- per-step work outside the forward


@pytest.mark.parametrize("confidence", ["raw", "sampled"])
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (0.0, 3), (0.7, None)])
def test_confidence_is_the_softmax_at_the_proposal_bit_for_bit(confidence, temperature, top_k):
    """token_stats reads exp(logit[x0] - logsumexp) instead of a softmax over the vocabulary
    (and one normaliser when nothing processed the logits): the same float32 values as the
    softmax's element at x0, so every rule commits the same positions."""
    from mlx_dllm_models.decoding.stats import filter_logits, softmax_stats, token_stats

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 9, 300)).astype(np.float32) * 4
    logits[0, 1] = -np.inf  # a row without a finite logit: confidence 0
    logits[1, 2, :5] = np.nan
    logits = mx.array(logits)
    key = mx.random.key(0) if temperature else None
    s = token_stats(logits, temperature=temperature, top_k=top_k, key=key, confidence=confidence)
    clean = mx.where(mx.isnan(logits), float("-inf"), logits)
    scores = clean
    if confidence == "sampled":
        scores = filter_logits(clean / temperature if temperature else clean, top_k=top_k)
    p, _, entropy = softmax_stats(scores if confidence == "sampled" else clean)
    finite = mx.any(clean > float("-inf"), axis=-1)
    want = mx.where(finite, mx.take_along_axis(p, s.x0[..., None], axis=-1)[..., 0], 0.0)
    assert np.array_equal(np.array(s.confidence), np.array(want))
    assert np.array_equal(np.array(s.entropy), np.array(softmax_stats(clean)[2]))


def test_rank_is_reused_only_for_the_same_arrays():
    """A step's rule and its quota floor rank the same confidences once; other arrays (even equal
    ones) are ranked afresh."""
    from mlx_dllm_models.decoding import quota_commit, threshold_commit

    conf = mx.array([[0.2, 0.9, 0.5, 0.7]])
    cand = mx.array([[True, True, True, False]])
    hit = threshold_commit(conf, cand, 0.95) | quota_commit(conf, cand, 2)
    assert hit.tolist() == [[False, True, True, False]]
    flipped = mx.array([[0.9, 0.2, 0.5, 0.7]])
    assert quota_commit(flipped, cand, 1).tolist() == [[True, False, False, False]]
    assert quota_commit(conf, mx.array([[True, False, True, True]]), 1).tolist() == [
        [False, False, False, True]
    ]


_FIRST_FORWARDS = """
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_dllm_models.models import cpu_layers
for bits in (2, 4, 8):
    lin = nn.QuantizedLinear.from_linear(nn.Linear(256, 96), 64, bits)
    mx.eval(cpu_layers.linear(lin, mx.ones((2, 5, 256))))
    experts = SwitchLinear(64, 32, 8).to_quantized(32, bits)
    idx = mx.array([[[0, 3], [5, 3]]], dtype=mx.uint32)
    mx.eval(cpu_layers.gathered(experts, mx.ones((1, 2, 1, 1, 64)), idx))
"""


@pytest.mark.slow
def test_widening_compiles_one_kernel_for_every_width(tmp_path):
    """MLX's CPU backend builds each fused kernel with the system C++ compiler at its first use
    (about 1 s each, cached under $TMPDIR/mlx): widening 2-, 4- and 8-bit linears and expert
    gathers in a fresh interpreter with an empty cache builds one kernel (a shift baked into the
    kernel built 28, one per piece and layout)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _FIRST_FORWARDS], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert len(list(tmp_path.glob("mlx/*/cpu/*.so"))) == 1
