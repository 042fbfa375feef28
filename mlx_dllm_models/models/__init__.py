"""Model classes, one module per Hugging Face model_type, importable as mlx_lm.models.<type>.

The protocol every module follows (the engine relies on nothing else):

* `ModelArgs(BaseModelArgs)` reads config.json (real HF field names), `Model(nn.Module)` with
  `sanitize(weights)` mapping HF key names, and optionally `quant_predicate`, as in mlx-lm.
* `Model.__call__(inputs, cache=None, mask=None, head_span=None) -> logits (B, R, V)` where
  - `inputs`: (B, L) int token ids;
  - `cache`: None, or a list (one per layer) of objects with mlx-lm's protocol: `offset` (int or a
    (B,) array of per-row RoPE positions of the first input row) and `update_and_fetch(k, v)`;
  - `mask`: None, "causal", or a boolean keep-mask / additive mask broadcastable to
    (B, n_heads, L, n_keys); None with a cache attends to every key, None without one is the
    upstream model's own forward (docs/ARCHITECTURE.md, "the plain call");
  - `head_span`: None, or a `(start, stop)` span of the L positions: the hidden states are sliced
    before the LM head, so that the head (the most expensive matmul at large vocabularies) only runs
    over the positions whose logits are needed.
* `Model.diffusion_spec` -> `mlx_dllm_models.spec.DiffusionSpec`, built from the config.
* `Model.layers` (list of layers, for cache creation) and `Model.args`.
* Optionally `Model.image_spec` -> `mlx_dllm_models.image_spec.ImageSpec`: a family that writes
  images as tokens (MMaDA, whose image tokenizer is magvitv2.py's MAGVIT-v2, and Lumina-DiMOO,
  whose VQ-VAE is vqmodel.py's diffusers VQModel: modules of no model_type, as common.py or
  image_slots.py; lumina_dimoo.py holds the image facts llada.Model gives its checkpoints).
"""
