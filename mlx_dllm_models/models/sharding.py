"""Tensor parallelism over MLX's distributed group, as mlx-lm's models do it (`llama.Model.shard`,
`qwen3_moe.Model.shard`, `deepseek_v3.Model.shard`): what the families' `shard(group)` methods
share.

* Attention: q/k/v projections `all-to-sharded` (each rank computes its own heads), the output
  projection `sharded-to-all` (the partial products are summed over the group), the head counts
  divided by the group size. Where a checkpoint has fewer K/V heads than ranks (grouped-query
  attention), each rank keeps the one K/V head its query heads read: its rows of k/v, no
  communication (mlx-lm asserts divisibility instead).
* Dense MLP: gate/up `all-to-sharded`, down `sharded-to-all` (mlx-lm's sharded linears).
* Experts: the SwitchGLU weights split over the intermediate dimension in place
  (`shard_inplace`); the MoE block that owns them sums its output over the group once
  (`sharding_group`, as mlx-lm's MoE blocks do), so the router stays replicated and every rank
  routes every token to the same experts.

Embeddings, the LM head, norms, routers and the small extras (expert bias, layer scalars) stay
replicated: every rank holds the same hidden states after each all-reduce, and so the same logits.
"""

from typing import Optional

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_map

from ..errors import SettingsError


def group_of(group: Optional[mx.distributed.Group]) -> mx.distributed.Group:
    """The group a `shard(group)` call splits over: the given one, else the launch's (mlx-lm's
    default)."""
    return group or mx.distributed.init()


# The layers every family splits over their inputs (`sharded-to-all`).
SPLIT_INPUTS = ("o_proj", "dense", "down_proj")

# The config sizes a tensor-parallel split of attention divides.
HEADS = ("num_attention_heads", "num_key_value_heads")


def config_sizes(args, *names) -> dict:
    """{config key: value} of the sizes a split must divide; keys the config leaves unset (None
    or 0, e.g. no shared expert) are left out."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None)}


def check_divisible(family: str, group, sizes: dict, kv_heads: dict = (), model=None) -> None:
    """A SettingsError naming every size that the group cannot split evenly, before any weight is
    touched: mlx's own error (an unequal split deep inside `shard_linear`) says neither which
    size nor what to do. `kv_heads` sizes may also divide the group size instead (each rank then
    keeps one K/V head). With `model`, its quantized layers that are split over their inputs must
    split into whole quantization groups."""
    n = group.size()
    if model is not None and n > 1:
        _check_quantized_inputs(family, model, n)
    kv_heads = dict(kv_heads)
    bad = {k: v for k, v in sizes.items() if v % n}
    bad.update({k: v for k, v in kv_heads.items() if v % n and n % v})
    if bad:
        listed = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise SettingsError(
            f"{family}: cannot split the checkpoint over {n} ranks: {listed} is not divisible by "
            f"{n}. Launch a number of ranks that divides "
            + ", ".join(f"{k} ({v})" for k, v in {**sizes, **kv_heads}.items())
            + "."
        )


def checked_group(model, group, family: str, *widths: str) -> mx.distributed.Group:
    """The group of `model.shard(group)` (group_of), once check_divisible has found that it splits
    the attention heads and the config's `widths` (e.g. "intermediate_size") evenly: what a family
    built on an mlx-lm body runs before handing the split to that body's own `shard`."""
    group = group_of(group)
    check_divisible(family, group, config_sizes(model.args, *HEADS, *widths), model=model)
    return group


def checked_gqa_group(model, group, family: str, *widths: str) -> mx.distributed.Group:
    """checked_group for the families whose split keeps one K/V head a rank where the K/V heads
    are fewer than the ranks (shard_attention): the K/V head count may divide the group size
    instead."""
    group = group_of(group)
    sizes = config_sizes(model.args, "num_attention_heads", *widths)
    kv = config_sizes(model.args, "num_key_value_heads")
    check_divisible(family, group, sizes, kv, model=model)
    return group


def shard_attention(
    attn,
    group,
    *,
    q: str = "q_proj",
    k: str = "k_proj",
    v: Optional[str] = "v_proj",
    o: str = "o_proj",
    heads: str = "n_heads",
    kv_heads: str = "n_kv_heads",
) -> None:
    """llama.Model.shard's attention split on any attention module that names its projections
    and head counts; `v` None for K=V attention (one projection for both)."""
    n, rank = group.size(), group.rank()
    setattr(attn, q, shard_linear(getattr(attn, q), "all-to-sharded", group=group))
    setattr(attn, o, shard_linear(getattr(attn, o), "sharded-to-all", group=group))
    setattr(attn, heads, getattr(attn, heads) // n)
    n_kv = getattr(attn, kv_heads)
    names = [k] if v is None or v not in attn else [k, v]
    if n_kv % n == 0:
        for name in names:
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        setattr(attn, kv_heads, n_kv // n)
        return
    # Fewer K/V heads than ranks: rank r's query heads all read K/V head r * n_kv // n.
    head = rank * n_kv // n

    def rows(w):
        size = w.shape[0] // n_kv
        return mx.contiguous(w[head * size : (head + 1) * size])

    for name in names:
        layer = getattr(attn, name)
        layer.update(tree_map(rows, layer.parameters()))
    setattr(attn, kv_heads, 1)


def shard_mlp(mlp, group) -> None:
    """A gated MLP (gate_proj, up_proj, down_proj) split over its intermediate dimension."""
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_mlp_inplace(mlp, group, family: str) -> None:
    """A gated MLP or SwitchGLU split in place; the module that owns it sums over the group. A
    down-projection bias would be summed once per rank, so it is refused."""
    if "bias" in mlp.down_proj:
        raise SettingsError(
            f"{family}: expert MLPs with biases (use_bias=true) cannot be sharded yet; run the "
            "checkpoint on one machine."
        )
    shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.down_proj, "sharded-to-all", group=group)


def _check_quantized_inputs(family: str, model, n: int) -> None:
    for path, module in model.named_modules():
        if path.rpartition(".")[2] not in SPLIT_INPUTS or not hasattr(module, "group_size"):
            continue
        inputs = module.weight.shape[-1] * 32 // module.bits
        if (inputs // n) % module.group_size:
            raise SettingsError(
                f"{family}: {path} is quantized in groups of {module.group_size} along its "
                f"{inputs} inputs, which {n} ranks cannot split into whole groups "
                f"({inputs // n} inputs each). Convert the checkpoint with a --q-group-size that "
                f"divides {inputs // n} (e.g. 32), or launch a number of ranks that keeps whole "
                "groups."
            )
