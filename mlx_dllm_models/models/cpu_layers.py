"""Half-precision and quantized weights through float32 matmuls on MLX's CPU backend.

On the CPU, MLX multiplies float32 through BLAS, but bfloat16 / float16 matmuls and
`quantized_matmul` / `gather_qmm` run in its own single-threaded loops (an order of magnitude
slower or worse: BENCHMARKS.md, "Half-precision and quantized weights on MLX's CPU backend"), and
`gather_mm` refuses any dtype but float32 (a bfloat16 MoE cannot run at all). Attention over
half-precision activations takes the same slow matmuls. So when the default device is the CPU,
`use_float32_matmuls(model)` (loader.load calls it) turns the model's half-precision and quantized
weight layers into variants that widen their weight to float32 inside the forward and return
float32: the activations, and with them attention and the K/V caches, are float32 from the
embedding on. The model then computes what the float32 upcast of its weights computes (the logits
agree to float32 rounding; a half-precision checkpoint's bit for bit) without holding that upcast:
a widened weight lives from shortly before its matmul until the matmul is done. MLX's CPU
scheduler allocates the outputs of the ops it runs ahead to (about a hundred), so a forward holds
at most about one layer's widened weights plus the widened LM head (the largest matmul), never the
model's. A head or table over CHUNK_ELEMENTS is widened in slices of rows, which lets MLX's
memory-limit throttle wait between them.

The variants are subclasses of mlx's and mlx-lm's layer classes with the same parameters (the
instances' classes are swapped in place): saving, LoRA, fusing and quantization see the layers they
know. Each checks the device again when called and otherwise runs its parent's forward, so on
Metal or CUDA nothing changes. Float32 layers are left alone.

Widening: a half-precision weight by `astype`; an affine-quantized one (2, 4 or 8 bits) as `32 /
bits` float32 pieces, piece p holding the columns p, p + 32/bits, ... (one compiled kernel, the
shift an input; `mx.dequantize` is slower here), multiplied by
the matching columns of the input and summed. Other quantization modes and widths go through
`mx.dequantize`. An expert gather widens each expert its pairs select once (the distinct experts
read from the indices on the host), then runs float32 gather_mm, or, for sorted pairs that
number at least GROUPED_PAIRS_PER_EXPERT an expert (a prefill, a full-recompute forward), one
BLAS matmul per expert: MLX's CPU gather_mm multiplies pair by pair. A quantized one whose experts
serve about one pair each runs MLX's gather_qmm, faster there.

Freed buffers of a widened weight are reused by the next layer of the same shape only when MLX's
allocator keeps them (its CPU buffer cache is small by default): `use_float32_matmuls` raises that
cache to 1.5 times what a forward holds widened (`widened_bytes`; never lowers it), memory the
forward takes at every step anyway. Without it every widening pays the page faults of fresh
memory.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# The most elements of one widened slice of an LM head or embedding table (256 MB of float32).
CHUNK_ELEMENTS = 1 << 26
# Below this many token-expert pairs per distinct selected expert, a quantized expert gather runs
# MLX's gather_qmm instead of widening (see `gathered`).
QMM_PAIRS_PER_EXPERT = 1.3
# From this many sorted pairs per distinct selected expert, an expert gather runs one matmul per
# expert instead of MLX's pair-by-pair gather_mm (see `_grouped`).
GROUPED_PAIRS_PER_EXPERT = 8.0

HALF = (mx.float16, mx.bfloat16)
F32 = mx.float32


def on_cpu() -> bool:
    """Whether layers run on MLX's CPU backend now (the default device)."""
    return mx.default_device().type == mx.cpu


# ------------------------------------------------------------------------------------ widening


def _unpack_piece(packed, shift, mask, scales, biases):
    return scales * ((packed >> shift) & mask).astype(F32) + biases


# One compiled kernel serves every piece of every width: the shift and the mask are inputs, not
# constants. MLX's CPU backend compiles each fused kernel with the system C++ compiler at its
# first use (cached in $TMPDIR/mlx), so a constant shift would make a kernel per piece and width,
# each compiled by the first forward that reads it.
UNPACK_PIECE = mx.compile(_unpack_piece, shapeless=True)
PIECE_BITS = (2, 4, 8)


def _pieces(
    weight, scales=None, biases=None, group_size=None, bits=None, mode="affine", whole=False
):
    """`weight` (..., rows, columns) widened to float32, as a list of pieces W_p with
    W[..., p::len(pieces)] == W_p: one piece unless packed affine fields are unpacked apart
    (never with `whole`)."""
    if scales is None:
        return [weight.astype(F32)]
    per = 32 // bits
    split = not whole and bits in PIECE_BITS and group_size % per == 0
    if split and mode == "affine" and biases is not None:
        # Packed word j of a row holds columns per * j ... per * j + per - 1, all in group
        # j // (group_size / per): its scale and bias repeated per word.
        s = mx.repeat(scales.astype(F32), group_size // per, axis=-1)
        b = mx.repeat(biases.astype(F32), group_size // per, axis=-1)
        mask = mx.array((1 << bits) - 1, mx.uint32)
        return [UNPACK_PIECE(weight, mx.array(p * bits, mx.uint32), mask, s, b) for p in range(per)]
    if mode == "affine":
        scales = scales.astype(F32)
        biases = None if biases is None else biases.astype(F32)
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits, mode=mode)
    return [w.astype(F32)]


def _layer_pieces(layer, rows=None, experts=None):
    """The float32 pieces of a layer's weight: its rows `rows` (a slice), or for experts the
    stacked weights of `experts` (an index array)."""

    def part(name):
        a = layer.get(name)
        if a is None:
            return None
        if experts is not None:
            a = a[experts]
        return a if rows is None else a[..., rows, :]

    if "scales" not in layer:
        return _pieces(part("weight"))
    return _pieces(
        part("weight"),
        part("scales"),
        part("biases"),
        layer.group_size,
        layer.bits,
        layer.mode,
    )


def _columns(x, n):
    """x's last axis split as the pieces split their columns."""
    if n == 1:
        return [x]
    x = x.reshape(*x.shape[:-1], -1, n)
    return [x[..., p] for p in range(n)]


def _times_transposed(x, pieces):
    """x @ W.T over W's pieces (the pieces' products accumulate in BLAS)."""
    y = None
    for xp, wp in zip(_columns(x, len(pieces)), pieces):
        wt = wp.swapaxes(-1, -2)
        y = xp @ wt if y is None else mx.addmm(y, xp, wt)
    return y


def _rows_of(layer) -> int:
    return layer["weight"].shape[-2]


def _columns_of(layer) -> int:
    if "scales" in layer:
        return layer["scales"].shape[-1] * layer.group_size
    return layer["weight"].shape[-1]


def _row_chunks(layer):
    """Row slices of a 2-D weight, each widened to at most CHUNK_ELEMENTS (one slice when the
    weight is that small)."""
    rows = _rows_of(layer)
    step = max(1, CHUNK_ELEMENTS // _columns_of(layer))
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


def linear(layer, x):
    """x @ W.T (+ bias) of a Linear-like layer (weight, maybe scales / biases / bias), in
    float32 with W widened a slice of rows at a time."""
    x = x.astype(F32)
    chunks = _row_chunks(layer)
    if len(chunks) == 1:
        y = _times_transposed(x, _layer_pieces(layer))
    else:
        y = mx.concatenate([_times_transposed(x, _layer_pieces(layer, c)) for c in chunks], -1)
    if "bias" in layer:
        y = y + layer["bias"].astype(F32)
    return y


def rows_times(layer, p):
    """p @ W of a table W (vocabulary, hidden): the probabilities' weighted sum of the rows
    (DiffusionGemma's self-conditioning), in float32, W widened a slice of rows at a time."""
    p = p.astype(F32)
    out = None
    for c in _row_chunks(layer):
        pieces = _layer_pieces(layer, c)
        parts = [p[..., c] @ wp for wp in pieces]
        y = parts[0] if len(parts) == 1 else mx.stack(parts, axis=-1).flatten(-2)
        out = y if out is None else out + y
    return out


def _host(indices):
    """The indices on the host, or None inside mx.compile (where they cannot be read)."""
    try:
        return np.array(indices)
    except ValueError:
        return None


def _grouped(x, pieces, rhs):
    """gather_mm of sorted pairs (x: (pairs, 1, columns), rhs: their experts on the host, in
    order) as one BLAS matmul per run of pairs of the same expert. MLX's CPU gather_mm multiplies
    pair by pair, which many pairs an expert (a prefill) turn into the forward's largest cost
    (BENCHMARKS.md, "A sorted expert gather of many pairs an expert")."""
    rhs = rhs.astype(np.int64)
    starts = np.flatnonzero(np.diff(rhs, prepend=-1))
    ends = np.append(starts[1:], rhs.size)
    rows = x[:, 0, :]
    out = [
        _times_transposed(rows[a:b], [wp[int(rhs[a])] for wp in pieces])
        for a, b in zip(starts.tolist(), ends.tolist())
    ]
    return mx.concatenate(out)[:, None, :]


def gathered(layer, x, indices, sorted_indices=False):
    """gather_mm / gather_qmm of mlx-lm's SwitchLinear (x @ W[e].T for each token-expert pair)
    in float32, each expert the pairs select widened once."""
    x = x.astype(F32)
    # One host read of the indices a call: a block's pairs select only some of the experts (a
    # 32-row block's 256 top-8 pairs, about two thirds of 256), and widening only those shrinks
    # the MoE step's largest cost. The read waits for the router, which the widening has to wait for anyway.
    host = _host(indices)
    experts = layer["weight"].shape[0]
    chosen = None if host is None else np.unique(host)
    if chosen is None or len(chosen) == experts:
        pieces, rhs, rhs_host = _layer_pieces(layer), indices, host
    else:
        if "scales" in layer and indices.size < QMM_PAIRS_PER_EXPERT * chosen.size:
            # Each expert serves about one pair (a small block, one token): one-row products,
            # where MLX's own gather_qmm reads the packed weight once and beats widening it
            # (BENCHMARKS.md, "After `gathered` widens only the selected experts": its cost grows
            # with the pairs, widening's with the distinct experts). Its output is float32 for
            # float32 input.
            return QuantizedSwitchLinear.__call__(layer, x, indices, sorted_indices)
        # The selected experts renumbered in order (a monotone map: sorted stays sorted).
        renumber = np.zeros(experts, np.uint32)
        renumber[chosen] = np.arange(len(chosen), dtype=np.uint32)
        rhs_host = renumber[host]
        pieces, rhs = _layer_pieces(layer, experts=mx.array(chosen)), mx.array(rhs_host)
    grouped = sorted_indices and x.ndim == 3 and x.shape[1] == 1 and host is not None
    if grouped and host.size >= GROUPED_PAIRS_PER_EXPERT * len(chosen):
        y = _grouped(x, pieces, rhs_host)
    else:
        y = None
        for xp, wp in zip(_columns(x, len(pieces)), pieces):
            wt = wp.swapaxes(-1, -2)
            g = mx.gather_mm(xp, wt, rhs_indices=rhs, sorted_indices=sorted_indices)
            y = g if y is None else y + g
    if "bias" in layer:
        y = y + mx.expand_dims(layer["bias"][indices], -2).astype(F32)
    return y


# ------------------------------------------------------------------------------------- layers


class CPULinear(nn.Linear):
    def __call__(self, x):
        return linear(self, x) if on_cpu() else super().__call__(x)


class CPUQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return linear(self, x) if on_cpu() else super().__call__(x)


class CPUEmbedding(nn.Embedding):
    def __call__(self, x):
        return self["weight"][x].astype(F32) if on_cpu() else super().__call__(x)

    def as_linear(self, x):
        return linear(self, x) if on_cpu() else super().as_linear(x)


class CPUQuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x):
        if not on_cpu():
            return super().__call__(x)
        biases = self.get("biases")
        return _pieces(
            self["weight"][x],
            self["scales"][x],
            None if biases is None else biases[x],
            self.group_size,
            self.bits,
            self.mode,
            whole=True,  # the table's column order; the rows gathered are few
        )[0]

    def as_linear(self, x):
        return linear(self, x) if on_cpu() else super().as_linear(x)


class CPUSwitchLinear(SwitchLinear):
    def __call__(self, x, indices, sorted_indices=False):
        if not on_cpu():
            return super().__call__(x, indices, sorted_indices)
        return gathered(self, x, indices, sorted_indices)


class CPUQuantizedSwitchLinear(QuantizedSwitchLinear):
    def __call__(self, x, indices, sorted_indices=False):
        if not on_cpu():
            return super().__call__(x, indices, sorted_indices)
        return gathered(self, x, indices, sorted_indices)


VARIANTS = {
    nn.Linear: CPULinear,
    nn.QuantizedLinear: CPUQuantizedLinear,
    nn.Embedding: CPUEmbedding,
    nn.QuantizedEmbedding: CPUQuantizedEmbedding,
    SwitchLinear: CPUSwitchLinear,
    QuantizedSwitchLinear: CPUQuantizedSwitchLinear,
}
PARENTS = {variant: base for base, variant in VARIANTS.items()}
PARENTS_OF_EXPERTS = (SwitchLinear, QuantizedSwitchLinear)
TABLES = (CPUEmbedding, CPUQuantizedEmbedding)


def _narrow(module) -> bool:
    """Quantized, or a half-precision weight."""
    return "scales" in module or module["weight"].dtype in HALF


def _widened_bytes(module) -> int:
    experts = module["weight"].shape[0] if isinstance(module, PARENTS_OF_EXPERTS) else 1
    return 4 * experts * _rows_of(module) * _columns_of(module)


def use_float32_matmuls(model) -> int:
    """On the CPU backend, swap the model's half-precision and quantized Linear, Embedding and
    SwitchLinear layers (mlx's and mlx-lm's classes exactly; float32 ones stay) for the float32
    variants above, and let MLX's allocator keep about one layer's widened weights for reuse;
    returns how many layers were swapped. Elsewhere (Metal, CUDA) it does nothing."""
    if not on_cpu():
        return 0
    swapped = 0
    for _, module in model.named_modules():
        variant = VARIANTS.get(type(module))
        if variant is not None and _narrow(module):
            module.__class__ = variant
            swapped += 1
    if swapped:
        keep = 3 * widened_bytes(model) // 2
        previous = mx.set_cache_limit(keep)
        if previous > keep:
            mx.set_cache_limit(previous)
    return swapped


def widened_bytes(model) -> int:
    """What one forward holds widened at a time, about: MLX's CPU scheduler allocates the outputs
    of the ops it runs ahead to (about a hundred), which covers a layer (all its swapped weights,
    every expert of an MoE) and the whole LM head (its slices are independent ops)."""

    def swapped(module):
        return [m for _, m in module.named_modules() if type(m) in PARENTS]

    blocks = list(getattr(model, "layers", None) or [])
    in_blocks = {id(m) for b in blocks for m in swapped(b)}
    per_block = [sum(_widened_bytes(m) for m in swapped(b)) for b in blocks]
    others = [_widened_bytes(m) for m in swapped(model) if id(m) not in in_blocks]
    return max(per_block, default=0) + max(others, default=0)


def restore_layers(model) -> int:
    """Undo `use_float32_matmuls`: the layers' own classes back; returns how many."""
    restored = 0
    for _, module in model.named_modules():
        base = PARENTS.get(type(module))
        if base is not None:
            module.__class__ = base
            restored += 1
    return restored
