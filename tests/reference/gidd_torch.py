"""Independent torch reference for GIDD: the checkpoints' remote `modeling_gidd.py`
(dvruette/gidd-easydel @ 6525e88, gidd_easydel/model/modeling_gidd_hf.py: GiddForDiffusionLM's
forward and its `generate`, `_sample_prior`, `_probs_with_topk_topp`, `_pi_lambda`,
`_sample_ancestral`, `_sample_adaptive`), transcribed plainly (read in the code index, not copied).

* `reference_logits`: the forward ("eager" attention: soft-capped scores, the learned k_bias /
  v_bias pair before every key, masked with finfo.min, float32 softmax) under a (B, Lq, Lk)
  boolean mask (None: all true), after a prefix's K/V when given, as upstream's past_key_values.
* `generate`: the loop for one prompt, its random draws given: `prior_uniforms` / `prior_ids`
  (what `_sample_prior`'s torch.rand / torch.randint draw for the positions after the prompt) and
  `draws`, a callable giving each step's uniforms where upstream calls torch.multinomial (by
  inverse CDF of the normalized weights; `theirs` gives the package's draw of each such call, see
  `_multinomial`). At temperature 0 `_sample_adaptive`'s multinomial of a
  one-hot is its argmax, taken here without a draw. Returns the canvas (after the loop, before
  upstream's EOS padding), the forwards run and where the last decoded block ends.
"""

import functools
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

torch.set_num_threads(1)


@functools.lru_cache(maxsize=2)
def load_reference(ckpt):
    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    weights = {
        k: torch.from_numpy(np.array(v)) for k, v in load_file(ckpt / "model.safetensors").items()
    }
    return cfg, weights


def _linear(x, w, scale, b=None):
    y = x @ w.T
    if scale != 1.0:
        y = y * scale
    return y if b is None else y + b


def _scale(cfg, fan_in):
    s = cfg["weight_scaling"]
    return fan_in**-0.5 if s == "fan_in" else float(s)


def _norm(x, w, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((1 + w) * h).to(x.dtype)


def _rope(x, positions, dim, base):
    inv = 1.0 / torch.pow(base, torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.einsum("i,j->ij", torch.arange(4096, dtype=torch.float32), inv)
    cos, sin = freqs.cos()[positions], freqs.sin()[positions]  # (B, L, D/2)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _attention(cfg, W, p, h, mask, positions, past):
    B, L, _ = h.shape
    heads, hd = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    sc = _scale(cfg, cfg["hidden_size"])
    q = _linear(h, W[p + "q_proj.weight"], sc)
    k = _linear(h, W[p + "k_proj.weight"], sc)
    v = _linear(h, W[p + "v_proj.weight"], sc)
    q = _norm(q, W[p + "q_norm.weight"], cfg["rms_norm_eps"])
    k = _norm(k, W[p + "k_norm.weight"], cfg["rms_norm_eps"])
    q, k, v = (t.view(B, L, heads, hd) for t in (q, k, v))
    q, k = _rope(q, positions, hd, cfg["rope_theta"]), _rope(k, positions, hd, cfg["rope_theta"])
    mask = torch.cat([torch.ones(mask.shape[:2] + (1,), dtype=torch.bool), mask], dim=-1)
    if past is not None:
        k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
    else:
        kb = W[p + "k_bias"].view(1, 1, heads, hd).expand(B, 1, heads, hd)
        vb = W[p + "v_bias"].view(1, 1, heads, hd).expand(B, 1, heads, hd)
        k, v = torch.cat([kb, k], 1), torch.cat([vb, v], 1)
    present = (k, v)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.transpose(1, 2) * hd**-0.5, k.transpose(1, 2))
    cap = cfg["attn_soft_cap"]
    scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.to(torch.float32), dim=-1).to(scores.dtype)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v.transpose(1, 2))
    out = out.transpose(1, 2).reshape(B, L, heads * hd)
    return _linear(out, W[p + "o_proj.weight"], _scale(cfg, heads * hd)), present


def forward(ckpt, ids, mask=None, positions=None, past=None):
    """(logits (B, L, V) float32, per-layer K/V with the sink pair) of `ids` (B, L)."""
    cfg, W = load_reference(str(ckpt))
    ids = torch.as_tensor(ids, dtype=torch.long)
    B, L = ids.shape
    if mask is None:
        mask = torch.ones((B, L, L), dtype=torch.bool)
    if positions is None:
        positions = torch.arange(L).unsqueeze(0).expand(B, L)
    h = W["model.embed_tokens.weight"][ids]
    n = cfg["num_hidden_layers"]
    resid = cfg["resid_scale"] / n
    presents = []
    for i in range(n):
        p = f"model.layers.{i}."
        a, kv = _attention(
            cfg,
            W,
            p + "self_attn.",
            _norm(h, W[p + "attn_layernorm.weight"], cfg["rms_norm_eps"]),
            mask,
            positions,
            None if past is None else past[i],
        )
        presents.append(kv)
        h = h + resid * a
        m = _norm(h, W[p + "mlp_layernorm.weight"], cfg["rms_norm_eps"])
        sc = _scale(cfg, cfg["hidden_size"])
        m = torch.relu(_linear(m, W[p + "mlp.up_proj.weight"], sc, W[p + "mlp.up_proj.bias"])) ** 2
        sc = _scale(cfg, cfg["intermediate_size"])
        h = h + resid * _linear(m, W[p + "mlp.down_proj.weight"], sc, W[p + "mlp.down_proj.bias"])
    h = _norm(h, W["model.norm.weight"], cfg["rms_norm_eps"])
    return _linear(h, W["lm_head.weight"], cfg["head_scaling"]), presents


def reference_logits(ckpt, ids, mask=None, causal=False):
    """float32 logits (B, L, V) under `mask` (None: every key); `causal`: under a causal mask
    instead, a reading GIDD's forward never takes (the conformance rows' wrong reading)."""
    ids = np.asarray(ids)
    if causal:
        mask = np.broadcast_to(
            np.tril(np.ones((ids.shape[1],) * 2, bool)), ids.shape + ids.shape[1:]
        )
    with torch.no_grad():
        mask = None if mask is None else torch.as_tensor(np.array(mask))
        return forward(ckpt, ids, mask)[0].numpy()


# ---------------------------------------------------------------------------------- generate


def _multinomial(weights, u, theirs=None, tie=1e-5):
    """torch.multinomial's draw by inverse CDF of the uniforms `u`. `theirs`: the package's draw
    of the same step; where the two differ, every CDF boundary between them must lie within `tie`
    of the uniform (float32 rounding decides such a draw: the CDFs here and there differ by about
    1e-6), and the reference goes on from the package's side of it."""
    cdf = torch.cumsum(weights / weights.sum(-1, keepdim=True), dim=-1)
    idx = (cdf <= u.unsqueeze(-1)).sum(-1).clamp(max=weights.shape[-1] - 1)
    if theirs is None:
        return idx
    theirs = torch.as_tensor(np.asarray(theirs), dtype=torch.long).view(idx.shape)
    for at in zip(*torch.nonzero(idx != theirs, as_tuple=True)):
        lo, hi = sorted((int(idx[at]), int(theirs[at])))
        gap = (cdf[at][lo:hi] - u[at]).abs().max()
        assert gap <= tie, f"draw at {at}: {int(idx[at])} here, {int(theirs[at])} there"
    return theirs


def _probs(logits, temperature, top_p, top_k):
    if temperature == 0.0:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    x = logits / temperature
    if top_k is not None and 0 < top_k < x.size(-1):
        kth = torch.topk(x, top_k, dim=-1).values[..., -1, None]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(x, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        x = x.scatter(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    return torch.softmax(x, dim=-1)


def _pi(cfg, log_snr, mask_id):
    V = cfg["vocab_size"]
    unif = torch.ones((V,)) / (V - 1)
    unif[mask_id] = 0.0
    alpha = torch.sigmoid(log_snr + cfg["noise_type"])
    pi = alpha * unif
    pi[..., mask_id] = 1.0 - alpha
    return pi


def _ancestral(cfg, z, x_hat, t, s, mask_id, u, theirs):
    alpha_s, alpha_t = s.sigmoid(), t.sigmoid()
    beta_s, beta_t = 1.0 - alpha_s, 1.0 - alpha_t
    alpha_t_s = alpha_t / alpha_s
    pi_s, pi_t = _pi(cfg, s, mask_id), _pi(cfg, t, mask_id)
    beta_pi_t_s = beta_t * pi_t - alpha_t_s * beta_s * pi_s
    q_t = alpha_t * x_hat + beta_t * pi_t[None, None, :]
    q_s = alpha_s * x_hat + beta_s * pi_s[None, None, :]
    q_t_at_z = q_t.gather(-1, z.unsqueeze(-1)).squeeze(-1)
    z_vec = torch.nn.functional.one_hot(z, num_classes=cfg["vocab_size"]).to(q_t.dtype)
    p = q_s * (alpha_t_s * z_vec + beta_pi_t_s[z, None]) / q_t_at_z[..., None]
    # Upstream's multinomial raises on the 0 / 0 of a token the noise at t cannot hold (the mask id
    # drawn into a uniform-noise canvas); the package draws it from q_s (decoding.gidd).
    impossible = q_t_at_z == 0
    p = torch.where(impossible[..., None], q_s, p)
    return _multinomial(p, u, theirs)


def _adaptive(cfg, z, logits, log_snr, n, mask_id, temperature, top_p, top_k, draws, theirs):
    p_noise = _pi(cfg, log_snr, mask_id)[z]
    p_noise = p_noise / p_noise.sum(dim=-1, keepdim=True)
    x_hat = logits.softmax(dim=-1)
    p_delta = (x_hat.max(dim=-1).values - x_hat.gather(-1, z.unsqueeze(-1)).squeeze(-1)) * p_noise
    where = torch.topk(p_delta, n, dim=-1).indices
    probs = _probs(logits, temperature, top_p, top_k)
    if temperature == 0.0:
        tokens = torch.argmax(probs, dim=-1)
    else:
        tokens = _multinomial(probs, torch.as_tensor(draws(z.shape[1])).view(z.shape), theirs())
    out = z.clone()
    rows = torch.arange(z.shape[0]).unsqueeze(-1)
    out[rows, where] = tokens[rows, where]
    return out


def generate(
    ckpt,
    prompt,
    prior_uniforms,
    prior_ids,
    draws,
    max_length,
    block_length,
    steps,
    temperature,
    sampling_method,
    noise_schedule="cosine",
    tokens_per_step=1,
    top_p=None,
    top_k=None,
    eos_token_id=1,
    mask_token_id=3,
    theirs=lambda: None,
):
    """(the canvas as a list, the forwards run, the end of the last block decoded) of upstream's
    generate on one prompt."""
    cfg, _ = load_reference(str(ckpt))
    total, P = cfg["max_position_embeddings"], len(prompt)
    p_unif = torch.sigmoid(torch.tensor(cfg["min_log_snr"]) + cfg["noise_type"])
    r = torch.as_tensor(np.asarray(prior_uniforms)).view(1, -1)
    unif = torch.as_tensor(np.asarray(prior_ids), dtype=torch.long).view(1, -1)
    x = torch.cat([torch.tensor([prompt]), torch.where(r < p_unif, unif, mask_token_id)], 1)
    positions = torch.arange(total).unsqueeze(0)
    noise_mask = torch.ones_like(x, dtype=torch.bool)
    noise_mask[:, :P] = False
    lo, hi = torch.tensor(cfg["min_log_snr"]), torch.tensor(cfg["max_log_snr"])
    a_min, a_max = torch.sigmoid(lo), torch.sigmoid(hi)
    ts = torch.linspace(0.0, 1.0, steps=steps + 1)
    f = 1.0 - ts if noise_schedule == "linear" else 0.5 + 0.5 * torch.cos(ts * torch.pi)
    alpha = (a_max - a_min) * f + a_min
    log_snrs = torch.log(alpha / (1.0 - alpha)).clip(lo, hi)
    nfe, blocks = 0, 0
    with torch.no_grad():
        while True:
            start = P + blocks * block_length
            stop = start + block_length
            attn = noise_mask[..., :, None] >= noise_mask[..., None, :]
            _, past = forward(ckpt, x[:, :start], attn[:, :start, :start], positions[:, :start])
            nfe += 1
            keep_logits = False
            for step in range(steps, 0, -1):
                if not keep_logits:
                    logits, _ = forward(
                        ckpt, x[:, start:], attn[:, start:], positions[:, start:], past
                    )
                    nfe += 1
                    active = logits[:, :block_length, :]
                    active[..., mask_token_id] = float("-inf")
                z_t = x[:, start:stop]
                if sampling_method == "ancestral":
                    x_hat = _probs(active.to(torch.float32), temperature, top_p, top_k)
                    u = torch.as_tensor(draws(z_t.shape[1])).view(z_t.shape)
                    z_s = _ancestral(
                        cfg,
                        z_t,
                        x_hat,
                        log_snrs[step],
                        log_snrs[step - 1],
                        mask_token_id,
                        u,
                        theirs(),
                    )
                else:
                    z_s = _adaptive(
                        cfg,
                        z_t,
                        active.to(torch.float32),
                        log_snrs[step],
                        tokens_per_step,
                        mask_token_id,
                        temperature,
                        top_p,
                        top_k,
                        draws,
                        theirs,
                    )
                keep_logits = bool((z_s == z_t).all())
                x[:, start:stop] = z_s
            blocks += 1
            noise_mask[:, :stop] = False
            if stop >= max_length + P or bool((x == eos_token_id).any()):
                break
    return x[0].tolist(), nfe, stop
