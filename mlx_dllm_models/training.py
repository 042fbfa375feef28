"""Masked-diffusion training with mlx: the loss, its SFT form, a small loop, LoRA, and saving.

The loss is LLaDA's (GUIDELINES.md, "Pre-training" and "SFT"), which is MDLM's absorbing-state
ELBO: one noise level t ~ U(0, 1) per sequence, mask probability p = (1 - eps) t + eps, each token
masked independently with probability p, cross-entropy on the masked positions weighted by 1/p.

* pre-training form: `sum(CE / p over masked positions) / (B * L)`;
* SFT form: the prompt is never masked, and each row's sum is divided by its answer length
  (answer plus EOS padding, everything after the prompt) before averaging over the B rows:
  `sum(CE / p / answer_length) / B`;
* several answers a row (a few-shot prompt's solved examples, earlier turns): a `maskable` (B, L)
  mask replaces "after the prompt", and each row is divided by its count of maskable positions.

The loss works on the model protocol (`model(inputs) -> logits`) and reads the family's
`diffusion_spec` for the mask id and the logit shift, so any supported family can be fine-tuned;
Dream's logits are shifted (position i predicts from hidden state i-1) exactly as its decoder does.
"""

import json
from pathlib import Path
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .masks import every_key
from .spec import CAUSAL_WINDOW

Batch = Union[Mapping[str, mx.array], Tuple[mx.array, ...]]


# ------------------------------------------------------------------------------------------ loss


def sample_noise(key: Optional[mx.array], shape: Tuple[int, int], *, low_discrepancy: bool = False):
    """(t, u): one noise level t in [0, 1) per row and a uniform draw u per position (position i is
    masked when u[i] < p(t)). `low_discrepancy` spreads the B levels over [0, 1) as MDLM's sampler
    does (t_b = (b + r) / B, shuffled): the same marginal law, a lower-variance loss estimate.
    `key=None` draws from mlx's global generator (what a compiled training step tracks)."""
    B, L = shape
    k_t, k_u, k_p = mx.random.split(key, 3) if key is not None else (None, None, None)
    if low_discrepancy:
        r = mx.random.uniform(shape=(1,), key=k_t)
        t = (mx.arange(B) + r) / B
        t = t[mx.random.permutation(B, key=k_p)]
    else:
        t = mx.random.uniform(shape=(B,), key=k_t)
    u = mx.random.uniform(shape=(B, L), key=k_u)
    return t, u


def mask_probability(t: mx.array, eps: float = 1e-3) -> mx.array:
    """LLaDA's `p_mask = (1 - eps) * t + eps`: never exactly 0, so 1/p stays finite."""
    return (1 - eps) * t + eps


def forward_process(
    tokens: mx.array,
    t: mx.array,
    u: mx.array,
    mask_token_id: int,
    *,
    prompt_lengths: Optional[mx.array] = None,
    maskable: Optional[mx.array] = None,
    eps: float = 1e-3,
):
    """Noise a batch: returns (noisy tokens, masked positions, p per row). Prompt positions
    (`i < prompt_lengths[b]`), or the positions where `maskable` (B, L) is False, are never
    masked."""
    p = mask_probability(t, eps)
    masked = u < p[:, None]
    if maskable is not None:
        masked = masked & maskable
    noisy, masked = mask_tokens(tokens, masked, mask_token_id, prompt_lengths)
    return noisy, masked, p


def mask_tokens(
    tokens: mx.array,
    masked: mx.array,
    mask_token_id: int,
    prompt_lengths: Optional[mx.array] = None,
):
    """(noisy tokens, masked positions): `masked` (B, L) positions replaced by the mask token,
    prompt positions (`i < prompt_lengths[b]`) never. The forward process of the loss and of the
    likelihood estimators (likelihood.py), whatever chose the positions."""
    if prompt_lengths is not None:
        positions = mx.arange(tokens.shape[1])[None]
        masked = masked & (positions >= prompt_lengths[:, None])
    return mx.where(masked, mask_token_id, tokens), masked


def weighted_nll(logits: mx.array, tokens: mx.array, masked: mx.array, p: mx.array) -> mx.array:
    """(B, L) cross-entropy of `tokens` under aligned `logits`, divided by each row's mask
    probability `p` (B,), at the masked positions (0 elsewhere): the ELBO's terms, in float32."""
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), tokens, reduction="none")
    return mx.where(masked, ce / p[:, None], 0.0)


def align_logits(logits: mx.array, logit_shift: int) -> mx.array:
    """Logits aligned so that row i scores token i, as the family's decoder reads them (Dream:
    position i takes the logits of position i-1, position 0 keeps its own)."""
    if logit_shift == 0:
        return logits
    if logit_shift == 1:
        return mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
    raise ValueError(f"logit_shift={logit_shift} is not supported (0 or 1)")


def family_loss(spec, eps: float = 1e-3) -> Callable:
    """`diffusion_loss` with a family's mask token and logit shift, as
    f(model, tokens, t, u, prompt_lengths, maskable=None): what `train` and `mlx_dllm lora`
    minimise."""
    if spec.mask_token_id is None:
        raise ValueError(
            f"the {spec.family} family has no mask token (uniform diffusion): the absorbing-mask "
            "loss does not apply to it"
        )
    if spec.attention == CAUSAL_WINDOW:
        # WeDLM trains causally over reordered windows (its finetune/ code), not by denoising a
        # whole sequence under full attention: this loss would teach it something else.
        raise ValueError(
            f"the {spec.family} family's training objective (causal attention over reordered "
            "windows) is not implemented; the masked-diffusion loss under full attention would "
            "train another model"
        )

    def loss(model, tokens, t, u, prompt_lengths, maskable=None):
        return diffusion_loss(
            model,
            tokens,
            t,
            u,
            mask_token_id=spec.mask_token_id,
            logit_shift=spec.logit_shift,
            prompt_lengths=prompt_lengths,
            maskable=maskable,
            eps=eps,
        )

    return loss


def diffusion_loss(
    model: nn.Module,
    tokens: mx.array,
    t: mx.array,
    u: mx.array,
    *,
    mask_token_id: int,
    logit_shift: int = 0,
    prompt_lengths: Optional[mx.array] = None,
    maskable: Optional[mx.array] = None,
    eps: float = 1e-3,
) -> mx.array:
    """The masked-diffusion loss of `tokens` (B, L) under the draws (t, u).

    Without `prompt_lengths` or `maskable`: LLaDA's pre-training loss. With `prompt_lengths`: its
    SFT loss (prompt kept clean, each row normalised by its answer length L - prompt_length).
    `maskable` (B, L) generalises the SFT form to rows holding several answers (a prompt's solved
    examples, earlier turns): only its True positions may be masked, and each row is normalised by
    their count."""
    if prompt_lengths is not None and maskable is not None:
        raise ValueError("give prompt_lengths or maskable, not both")
    noisy, masked, p = forward_process(
        tokens, t, u, mask_token_id, prompt_lengths=prompt_lengths, maskable=maskable, eps=eps
    )
    B, L = tokens.shape
    # Every key, given explicitly: a call without a mask is the upstream forward, which is causal
    # or block-causal for some families.
    logits = model(noisy, mask=every_key(L))
    weighted = weighted_nll(align_logits(logits, logit_shift), tokens, masked, p)
    if maskable is not None:
        answer_lengths = maskable.sum(axis=1).astype(mx.float32)
    elif prompt_lengths is not None:
        answer_lengths = (L - prompt_lengths).astype(mx.float32)
    else:
        return weighted.sum() / (B * L)
    return (weighted.sum(axis=1) / answer_lengths).sum() / B


# ------------------------------------------------------------------------------------------ LoRA


def apply_lora(
    model: nn.Module,
    *,
    rank: int = 8,
    scale: float = 20.0,
    dropout: float = 0.0,
    num_layers: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
) -> nn.Module:
    """Freeze the model and put mlx-lm's LoRA adapters on the linear layers of the last
    `num_layers` layers (all by default; `keys` picks modules, e.g. ["self_attn.q_proj"])."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    config = {"rank": rank, "scale": scale, "dropout": dropout}
    if keys is not None:
        config["keys"] = list(keys)
    n = len(model.layers) if num_layers is None else num_layers
    linear_to_lora_layers(model, n, config)
    return model


def fuse_lora(model: nn.Module) -> nn.Module:
    """Fold LoRA adapters into their base weights (mlx-lm's `fuse`), leaving plain layers."""
    fused = [(name, m.fuse()) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


# ------------------------------------------------------------------------------------------ loop


def _unpack(batch: Batch, sft: bool):
    """(tokens, prompt_lengths, maskable) of a batch."""
    maskable = None
    if isinstance(batch, Mapping):
        tokens, prompt_lengths = batch["tokens"], batch.get("prompt_lengths")
        maskable = batch.get("maskable")
    elif isinstance(batch, (tuple, list)):
        tokens, prompt_lengths = batch[0], (batch[1] if len(batch) > 1 else None)
    else:
        tokens, prompt_lengths = batch, None
    tokens = mx.array(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"a batch's tokens must be (B, L) token ids, got shape {tokens.shape}")
    if not sft:
        return tokens, None, None
    if maskable is not None:  # with prompt_lengths too, diffusion_loss refuses the pair
        maskable = mx.array(maskable)
        if maskable.shape != tokens.shape or maskable.dtype != mx.bool_:
            raise ValueError(
                f"maskable must be booleans of the tokens' shape {tokens.shape}, got "
                f"{maskable.dtype} {maskable.shape}"
            )
        if not bool(maskable.any(axis=1).all()):
            raise ValueError("a row has no maskable position: it has no answer to train on")
        if prompt_lengths is not None:
            prompt_lengths = mx.array(prompt_lengths)
        return tokens, prompt_lengths, maskable
    if prompt_lengths is None:
        raise ValueError(
            "SFT needs prompt_lengths (or maskable) per row (give sft=False for the pre-training "
            "loss)"
        )
    prompt_lengths = mx.array(prompt_lengths)
    if int(prompt_lengths.max()) >= tokens.shape[1]:
        raise ValueError("a row's prompt fills the whole sequence: it has no answer to train on")
    return tokens, prompt_lengths, None


def train(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    optimizer: Optional[optim.Optimizer] = None,
    learning_rate: float = 1e-4,
    sft: bool = True,
    eps: float = 1e-3,
    seed: int = 0,
    low_discrepancy: bool = False,
    max_grad_norm: Optional[float] = None,
    spec=None,
    callback: Optional[Callable[[int, float], None]] = None,
) -> list:
    """Minimise the masked-diffusion loss over `batches` (one optimiser step each). A batch is
    {"tokens": (B, L), "prompt_lengths": (B,)} or a (tokens, prompt_lengths) tuple, or
    {"tokens", "maskable": (B, L) booleans} for rows holding several answers (`diffusion_loss`);
    with `sft=False` prompt lengths are ignored and every position may be masked. Only trainable
    parameters move (after `apply_lora`, the adapters). `low_discrepancy` spreads each batch's
    noise levels (see `sample_noise`). Returns the loss of each step."""
    spec = spec or model.diffusion_spec
    loss_fn = family_loss(spec, eps)
    optimizer = optimizer or optim.AdamW(learning_rate=learning_rate)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    key = mx.random.key(seed)
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        tokens, prompt_lengths, maskable = _unpack(batch, sft)
        key, sub = mx.random.split(key)
        t, u = sample_noise(sub, tokens.shape, low_discrepancy=low_discrepancy)
        loss, grads = loss_and_grad(model, tokens, t, u, prompt_lengths, maskable)
        if max_grad_norm is not None:
            grads, _ = optim.clip_grad_norm(grads, max_grad_norm)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(loss.item())
        if callback is not None:
            callback(step, losses[-1])
    model.eval()
    return losses


# ------------------------------------------------------------------------------------------ save


def hf_weights(model: nn.Module) -> Dict[str, mx.array]:
    """The model's weights under its checkpoint's Hugging Face names (LoRA must be fused first)."""
    weights = dict(tree_flatten(model.parameters()))
    if any("lora_" in k for k in weights):
        raise ValueError("the model still has LoRA adapters; call fuse_lora(model) first")
    # Families whose checkpoint names differ from this package's say so with `to_hf_weights`; the
    # others are saved under the names mlx-lm's convert writes, which their `sanitize` reads too.
    to_hf = getattr(model, "to_hf_weights", None)
    out = to_hf(weights) if to_hf is not None else weights
    # The loader must map the saved names back onto exactly these parameters.
    back = model.sanitize(dict(out))
    if set(back) != set(weights):
        raise ValueError("saved weight names do not round-trip through sanitize")
    return out


def save_checkpoint(
    path,
    model: nn.Module,
    config: Mapping,
    *,
    tokenizer=None,
    generation_config: Optional[Mapping] = None,
    dtype: Optional[mx.Dtype] = None,
) -> Path:
    """Write a trained model as a checkpoint in its family's HF layout: config.json,
    model.safetensors (HF key names), the tokenizer and generation_config.json. It loads through
    the same `mlx_dllm_models.load` / `mlx_lm convert` path as the real checkpoints."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fuse_lora(model)
    weights = hf_weights(model)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    config = dict(config)
    some = next(iter(weights.values()))
    config["torch_dtype"] = str(some.dtype).split(".")[-1]
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation_config is not None:
        (path / "generation_config.json").write_text(
            json.dumps(dict(generation_config), indent=2) + "\n"
        )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
