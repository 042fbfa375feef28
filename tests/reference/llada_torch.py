"""Independent torch references for the LLaDA family (tests only).

* `reference_logits(ckpt_path, input_ids)`: logits of a tiny LLaDA / LLaDA-MoE checkpoint computed by
  transformers' own models on renamed weights: LLaDA 8B = `LlamaForCausalLM` (its block is a Llama
  block under OLMo names), LLaDA-MoE = `Qwen3MoeForCausalLM` with `norm_topk_prob=False` (softmax
  router, top-k weights not renormalised, per-head q/k RMSNorm before RoPE, as the HF remote code).
  Attention is made fully bidirectional with an explicit 4-D additive mask of zeros under the eager
  kernel (transformers uses a 4-D mask as given); `causal=True` leaves transformers' causal mask.
  Gap: transformers' Qwen3-MoE has no partial rotary, so for `partial_rotary_factor < 1` the
  reference installs transformers' own GLM-4-MoE `apply_rotary_pos_emb` (rotates the first
  `rotary_dim` dims, NeoX style, passes the rest) and an `inv_freq` over `rotary_dim`, exactly what
  the LLaDA-MoE remote code does. Expert bias, shared experts and clip_qkv have no Qwen3-MoE
  counterpart and are refused.
* `llada_generate(...)`: a plain transcription of ML-GSAI/LLaDA `generate.py` (low_confidence
  remasking) and, with `threshold`, of NVlabs/Fast-dLLM `llada/generate.py` `get_transfer_index`.
"""

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _read(ckpt_path):
    from safetensors.numpy import load_file

    path = Path(ckpt_path)
    config = json.loads((path / "config.json").read_text())
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return config, weights


def _is_moe(config):
    return config.get("num_experts") is not None or any(
        "MoE" in a for a in config.get("architectures") or ()
    )


_OLMO_BLOCK = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}


def olmo_llama(config, weights):
    """LLaDA 8B's OLMo-named checkpoint as transformers' Llama (bidirectional under the caller's
    mask), with the context its forwards run in."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.get("include_bias") or config.get("include_qkv_bias") or config.get("weight_tying"):
        raise NotImplementedError("reference covers the LLaDA 8B layout: no biases, untied head")
    d, heads = config["d_model"], config["n_heads"]
    cfg = LlamaConfig(
        vocab_size=config.get("embedding_size") or config["vocab_size"],
        hidden_size=d,
        intermediate_size=config["mlp_hidden_size"],
        num_hidden_layers=config["n_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("n_kv_heads") or heads,
        head_dim=d // heads,
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        max_position_embeddings=config["max_sequence_length"],
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )
    state = {}
    for k, v in weights.items():
        parts = k.split(".")
        if parts[:3] == ["model", "transformer", "blocks"]:
            state[f"model.layers.{parts[3]}.{_OLMO_BLOCK[parts[4]]}.{parts[5]}"] = v
        else:
            top = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}[parts[2]]
            state[f"{top}.{parts[3]}"] = v
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(
        {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=True
    )
    return model.eval(), contextlib.nullcontext


def qwen3_moe(config, weights):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.glm4_moe import modeling_glm4_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    if config.get("shared_expert_intermediate_size") or config.get("moe_router_enable_expert_bias"):
        raise NotImplementedError(
            "Qwen3-MoE has no shared expert / expert bias of the LLaDA-MoE kind"
        )
    if config.get("clip_qkv") is not None or not config.get("qk_layernorm", True):
        raise NotImplementedError("reference needs qk_layernorm and no clip_qkv")
    d, heads, n = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = d // heads
    freq = config.get("moe_layer_freq") or [1] * n
    cfg = Qwen3MoeConfig(
        vocab_size=config["vocab_size"],
        hidden_size=d,
        intermediate_size=config.get("dense_intermediate_size") or 1,
        moe_intermediate_size=config["expert_intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        num_experts=config["num_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        norm_topk_prob=False,  # the LLaDA-MoE block hard-codes it, whatever the config says
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, f in enumerate(freq) if not f],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        max_position_embeddings=config["max_position_embeddings"],
        attention_bias=config.get("attention_bias", False),
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    state = {}
    n_experts = config["num_experts"]
    for k, v in weights.items():
        if ".mlp.experts." not in k:
            state[k] = v
    for i in range(n):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in weights:
            continue
        # transformers 5 stores experts fused: gate_up_proj (E, 2I, H) = [gate; up], down_proj (E, H, I).
        gate_up = [
            np.concatenate(
                [weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]]
            )
            for e in range(n_experts)
        ]
        state[f"{p}.gate_up_proj"] = np.stack(gate_up)
        state[f"{p}.down_proj"] = np.stack(
            [weights[f"{p}.{e}.down_proj.weight"] for e in range(n_experts)]
        )
    model = Qwen3MoeForCausalLM(cfg)
    model.load_state_dict(
        {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=True
    )

    rotary_dim = int(head_dim * config.get("partial_rotary_factor", 1.0))
    if rotary_dim == head_dim:
        return model.eval(), contextlib.nullcontext
    theta = config["rope_theta"]
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )
    model.model.rotary_emb.inv_freq = inv_freq
    model.model.rotary_emb.original_inv_freq = inv_freq

    @contextlib.contextmanager
    def partial_rotary():
        original = modeling_qwen3_moe.apply_rotary_pos_emb
        modeling_qwen3_moe.apply_rotary_pos_emb = modeling_glm4_moe.apply_rotary_pos_emb
        try:
            yield
        finally:
            modeling_qwen3_moe.apply_rotary_pos_emb = original

    return model.eval(), partial_rotary


_MODELS = {}


def load_model(ckpt_path):
    """(transformers model, the context its forwards run in) for a LLaDA checkpoint, built once
    per path."""
    key = str(Path(ckpt_path).resolve())
    if key not in _MODELS:
        config, weights = _read(ckpt_path)
        _MODELS[key] = (qwen3_moe if _is_moe(config) else olmo_llama)(config, weights)
    return _MODELS[key]


def torch_forward(ckpt_path, causal: bool = False):
    """A callable: (B, L) token ids (numpy or torch) -> float32 torch logits (B, L, V)."""
    model, context = load_model(ckpt_path)

    def forward(ids):
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        B, L = ids.shape
        # An explicit 4-D additive mask is used as given: zeros = every query sees every key.
        mask = None if causal else torch.zeros(B, 1, L, L, dtype=torch.float32)
        with torch.no_grad(), context():
            return model(input_ids=ids, attention_mask=mask).logits.float()

    return forward


def reference_logits(ckpt_path, input_ids: np.ndarray, causal: bool = False) -> np.ndarray:
    """float32 logits (B, L, V) of the checkpoint at `ckpt_path` (LLaDA 8B or LLaDA-MoE layout)."""
    return torch_forward(ckpt_path, causal=causal)(input_ids).numpy()


# --- generation ------------------------------------------------------------------------------


def add_gumbel_noise(logits, temperature, rand=None):
    """LLaDA: exp(logits) / (-log u)^T in float64; its argmax is a temperature-T sample. `rand(shape)`
    replaces torch.rand_like's draws (tests replay the engine's)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    if rand is None:
        noise = torch.rand_like(logits, dtype=torch.float64)
    else:
        noise = torch.as_tensor(np.asarray(rand(tuple(logits.shape)))).to(torch.float64)
    return logits.exp() / (-torch.log(noise)) ** temperature


def get_num_transfer_tokens(mask_index, steps):
    """Per row: n_masks // steps per step, the first n_masks % steps steps get one more."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num[i, : remainder[i]] += 1
    return num


def guided_logits(forward, x, prompt_index, cfg_scale, mask_id):
    """The step's logits; with `cfg_scale` > 0, classifier-free guidance against the row with its
    prompt masked."""
    if cfg_scale > 0.0:
        un_x = x.clone()
        un_x[prompt_index] = mask_id
        logits, un_logits = torch.chunk(forward(torch.cat([x, un_x], dim=0)), 2, dim=0)
        return un_logits + (cfg_scale + 1) * (logits - un_logits)
    return forward(x)


def remasking_confidence(logits, x0, remasking, rand):
    """Each position's confidence in its candidate `x0`, float64."""
    if remasking == "low_confidence":
        # Confidence is read from the raw logits (no temperature), in float64.
        p = F.softmax(logits.to(torch.float64), dim=-1)
        return torch.gather(p, dim=-1, index=x0[..., None])[..., 0]
    if remasking == "random":
        return rand((x0.shape[0], x0.shape[1])).to(torch.float64)
    raise NotImplementedError(remasking)


def select_transfer(confidence, mask_index, num_transfer_tokens, i, end, threshold):
    """The positions step `i` commits: per row its quota `num_transfer_tokens[j, i]` of the most
    confident, or with `threshold` Fast-dLLM's rule over every mask before `end`."""
    transfer_index = torch.zeros_like(confidence, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        if threshold is None:
            k = int(num_transfer_tokens[j, i])
        else:
            k = int(mask_index[j, :end].sum())
        _, select_index = torch.topk(confidence[j], k=k)
        transfer_index[j, select_index] = True
        if threshold is not None:
            # Fast-dLLM: the top-1 is always committed, the rest only above threshold.
            for r in range(1, k):
                if confidence[j, select_index[r]] < threshold:
                    transfer_index[j, select_index[r]] = False
    return transfer_index


def llada_generate(
    forward,
    prompt_ids,
    steps,
    gen_length,
    block_length,
    temperature=0.0,
    *,
    mask_id,
    threshold=None,
    return_nfe=False,
    cfg_scale=0.0,
    remasking="low_confidence",
    rand=None,
    logits_eos_inf=False,
    confidence_eos_eot_inf=False,
    eos_id=None,
    eot_id=None,
    suffix_ids=None,
    fill_prompt_masks=False,
    gumbel_rand=None,
):
    """LLaDA `generate` (semi-autoregressive blocks, low_confidence remasking), or with `threshold`
    Fast-dLLM's threshold rule. `steps` is the total over all blocks, as in the reference.
    Returns the full x (prompt + canvas) as numpy; with `return_nfe`, (x, number of forwards).

    The options of ML-GSAI/LLaDA generate.py: `cfg_scale` (prompt_index = x != mask_id at the
    start; the unconditional row masks it), `remasking` "low_confidence" / "random" (`rand(shape)`
    gives the uniform draws, torch.rand by default), `logits_eos_inf` and `confidence_eos_eot_inf`
    with the EOS / EoT ids that upstream hard-codes (126081 / 126348).
    Extensions for infilling: `suffix_ids` follow the canvas (x = [prompt, masks, suffix]; upstream
    puts the canvas last, its code is otherwise unchanged); `fill_prompt_masks` counts every mask
    before the block's end in the block's quota (upstream counts the block's only, and so leaves as
    many masks as the prompt held; the package fills them). `gumbel_rand(shape)` gives the Gumbel
    noise's uniform draws (torch.rand_like by default)."""
    prompt = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long)
    if prompt.ndim == 1:
        prompt = prompt[None]
    B, P = prompt.shape
    suffix = torch.as_tensor(np.asarray(suffix_ids if suffix_ids is not None else []))
    x = torch.full((B, P + gen_length + len(suffix)), mask_id, dtype=torch.long)
    x[:, :P] = prompt.clone()
    if len(suffix):
        x[:, P + gen_length :] = suffix.long()
    prompt_index = x != mask_id
    rand = rand or (lambda shape: torch.rand(shape))

    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    nfe = 0

    for num_block in range(num_blocks):
        start = P + num_block * block_length
        end = start + block_length
        counted = x[:, :end] if fill_prompt_masks else x[:, start:end]
        num_transfer_tokens = get_num_transfer_tokens(counted == mask_id, steps_per_block)
        i = 0
        while True:
            if threshold is None and i == steps_per_block:
                break
            if threshold is not None and (x[:, start:end] == mask_id).sum() == 0:
                break
            mask_index = x == mask_id
            logits = guided_logits(forward, x, prompt_index, cfg_scale, mask_id)
            nfe += 1
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf

            logits_with_noise = add_gumbel_noise(logits, temperature, gumbel_rand)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if confidence_eos_eot_inf:
                # Upstream's line, as is: at temperature 0 `logits_with_noise` IS `logits`, so both
                # EOS and EoT leave the confidence's softmax; above 0 it is a new array that is
                # never read again, and only EoT does.
                logits_with_noise[:, :, eos_id] = logits[:, :, eot_id] = -torch.inf
            x0_p = remasking_confidence(logits, x0, remasking, rand)
            x0_p[:, end:] = -np.inf

            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-np.inf, dtype=x0_p.dtype))

            transfer_index = select_transfer(
                confidence, mask_index, num_transfer_tokens, i, end, threshold
            )
            x[transfer_index] = x0[transfer_index]
            i += 1

    out = x.numpy()
    return (out, nfe) if return_nfe else out


# --- likelihood ------------------------------------------------------------------------------


def get_log_likelihood(forward, prompt, answer, draws, batch_size, cfg_scale=0.0, *, mask_id):
    """ML-GSAI/LLaDA `get_log_likelihood.py`, transcribed, with its random draws given: `draws`
    holds one (k, perms) per Monte-Carlo batch, k the `torch.randint(1, L + 1)` draw and perms
    (B, L) the rows' `torch.randperm(L)` results. `forward(ids)` -> logits (B, N, V)."""
    prompt = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    answer = torch.as_tensor(np.asarray(answer), dtype=torch.long)
    seq = torch.cat([prompt, answer])[None, :].repeat((batch_size, 1))
    prompt_index = torch.arange(seq.shape[1]) < len(prompt)

    def forward_process(batch, k, perms):
        b, l = batch.shape
        target_len = (l - prompt_index.sum()).item()
        x = torch.round(torch.linspace(float(k), k + (b - 1) * (target_len / b), steps=b)).long()
        x = ((x - 1) % target_len) + 1
        assert x.min() >= 1 and x.max() <= target_len
        indices = torch.arange(target_len).repeat(b, 1)
        is_mask = indices < x.unsqueeze(1)
        for i in range(b):
            is_mask[i] = is_mask[i][torch.as_tensor(np.asarray(perms[i]), dtype=torch.long)]
        is_mask = torch.cat((torch.zeros(b, prompt_index.sum(), dtype=torch.bool), is_mask), dim=1)
        noisy_batch = torch.where(is_mask, mask_id, batch)
        return noisy_batch, (x / target_len).unsqueeze(1).repeat(1, l)

    def get_logits(batch):
        if cfg_scale > 0.0:
            index = prompt_index.unsqueeze(0).repeat(batch.shape[0], 1)
            un_batch = batch.clone()
            un_batch[index] = mask_id
            batch = torch.cat([batch, un_batch])
        logits = torch.as_tensor(np.asarray(forward(batch))).double()
        if cfg_scale > 0.0:
            logits, un_logits = torch.chunk(logits, 2, dim=0)
            logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
        return logits

    loss_ = []
    for k, perms in draws:
        perturbed_seq, p_mask = forward_process(seq, k, perms)
        mask_index = perturbed_seq == mask_id
        logits = get_logits(perturbed_seq)
        loss = F.cross_entropy(logits[mask_index], seq[mask_index], reduction="none")
        loss = loss / p_mask[mask_index]
        loss_.append(loss.sum().item() / batch_size)
    return -sum(loss_) / len(loss_)


def suffix_greedy_prediction(forward, prefix, target, *, mask_id):
    """LLaDA `eval_llada.py`'s suffix_greedy_prediction (cfg 0): one token per step, the most
    confident of the masked positions, then compare with the target."""
    prefix = torch.as_tensor(np.asarray(prefix), dtype=torch.long)
    target = torch.as_tensor(np.asarray(target), dtype=torch.long)
    seq = torch.full((1, len(prefix) + len(target)), mask_id, dtype=torch.long)
    seq[0, : len(prefix)] = prefix
    for _ in range(len(target)):
        mask_index = seq == mask_id
        logits = torch.as_tensor(np.asarray(forward(seq)))[mask_index]
        x0 = torch.argmax(logits, dim=-1)
        p = torch.softmax(logits.to(torch.float32), dim=-1)
        confidence = torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)).squeeze(dim=-1)
        _, index = torch.sort(confidence, descending=True)
        x0[index[1:]] = mask_id
        seq[mask_index] = x0.clone()
    return bool(torch.all(target == seq[0, len(prefix) :]))
