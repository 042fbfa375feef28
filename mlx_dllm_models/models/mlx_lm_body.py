"""The base of the families whose body is an mlx-lm model (Qwen2, Qwen3, Qwen3-MoE): mlx-lm's
`Model` builds the weights and layers, sanitizes and shards them; this mixin runs its layers under
the caller's mask (the model protocol) and checks the checkpoint with a readable error.

A family is a class on `MaskedBody` and the body's mlx-lm `Model`, for example

    class Model(MaskedBody, qwen2.Model):
        family = "dream"
        layout = "Qwen2's layout, with q/k/v biases (e.g. ...)"
        config_keys = "num_hidden_layers, hidden_size, ..."

        spec_family = FAMILY  # the settings family (the model file's FAMILY)

        def spec_fields(self):
            return dict(settings=SETTINGS, samplers=..., defaults=...)

declaring:

* `family`: the name its errors speak of (`check_weights`, `drop_tied_head`, sharding);
* `layout` and `config_keys`: what `check_weights` says the checkpoint holds and what decides it;
* `shard_widths`: the config sizes a tensor-parallel split divides besides the attention heads
  (an MoE body: `moe_intermediate_size` too); `shard_name` where sharding errors name the family
  otherwise;
* `spec_family`, `attention` (bidirectional unless said), `missing_mask` (build_spec's message
  for a config without a mask id; None: such a config is accepted) and `spec_fields()`: the
  DiffusionSpec's fields beyond what build_spec reads from config.json. A family whose spec is
  built otherwise overrides `diffusion_spec` itself.

The head is the body's: mlx-lm's `Model` builds `lm_head` unless `args.tie_word_embeddings` (a
family whose head is always its own sets that flag false in its ModelArgs).

`plain_mask(length)` is what a call with neither mask nor cache attends with, so that
`model(ids)` (and mlx-lm's own calls that reach it) computes what the upstream model's forward
computes: None (every key) for the bidirectional families, "causal" where the upstream forward is
causal (WeDLM, Open-dCoder), a block-causal mask where it is block-causal (Fast-dLLM v2). With a cache, a
missing mask keeps meaning every key (the engine's unmasked denoising step); the engine's other
forwards pass their mask.
"""

from typing import Optional, Tuple

import mlx.core as mx

from ..spec import BIDIRECTIONAL, DiffusionSpec
from . import sharding
from .common import (
    build_spec,
    cached_spec,
    check_weights,
    drop_tied_head,
    drop_unused_buffers,
    masked_forward,
    refuse_autoregressive_tools,
    sanitize_experts,
)


class MaskedBody:
    """Mixin before an mlx-lm `Model` (see the module's docstring)."""

    family: str = ""
    layout: str = ""
    config_keys: str = ""
    shard_widths: Tuple[str, ...] = ("intermediate_size",)
    shard_name: Optional[str] = None
    spec_family: str = ""
    attention: str = BIDIRECTIONAL
    missing_mask: Optional[str] = None

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        if mask is None and cache is None:
            mask = self.plain_mask(inputs.shape[1])
        return masked_forward(self, self.model.embed_tokens, inputs, cache, mask, head_span)

    def spec_fields(self) -> dict:
        """The family's DiffusionSpec fields beyond build_spec's readings of config.json."""
        return {}

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        fields = self.spec_fields()
        return build_spec(self.args, self.spec_family, self.attention, self.missing_mask, **fields)

    def plain_mask(self, length: int):
        """The mask of a call with neither mask nor cache: the upstream forward's."""
        return None

    def sanitize(self, weights):
        weights = drop_unused_buffers(weights)
        weights = drop_tied_head(weights, self.family, self.args.tie_word_embeddings)
        # The body's own sanitize (an MoE body stacks its experts there).
        experts = vars(self.args).get("num_experts")
        weights = sanitize_experts(super().sanitize, weights, self.family, experts)
        return check_weights(self, weights, self.family, self.layout, self.config_keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """The body's mlx-lm `shard` (attention heads, MLPs and experts split over `group`),
        after a readable check that the group divides them."""
        name = self.shard_name or self.family
        group = sharding.checked_group(self, group, name, *self.shard_widths)
        super().shard(group)
