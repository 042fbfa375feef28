"""What the DiffusionGemma decoding tests share (tests/test_diffusion_gemma_decoding.py and
tests/test_diffusion_gemma_images.py): the checkpoint's fixtures, transformers' model of it, one
pre-drawn sequence of random draws that both sides consume, and each side's recorded steps."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_dllm_models.engine.canvas as canvas_mod
from fixtures import diffusion_gemma as fx
from helpers import checkpoint_fixtures
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.engine.canvas import CanvasStepEvent
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings

C = fx.CANVAS_LENGTH


def gemma_fixtures():
    """A test module's fixtures, bound as `checkpoint, dg, reference, eos_ids = gemma_fixtures()`:
    the checkpoint written once a session (`checkpoint`) and its load (`dg`), transformers' model
    of it (`reference`), both once a module, and `eos_ids`, which sets the model's EOS ids for one
    test."""
    checkpoint, dg = checkpoint_fixtures(
        "diffusion_gemma", fx.CHECKPOINTS["diffusion_gemma"], "dg", "checkpoint"
    )

    @pytest.fixture(scope="module")
    def reference(checkpoint):
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        model = DiffusionGemmaForBlockDiffusion.from_pretrained(
            str(checkpoint), dtype=torch.float32
        )
        return model.eval()

    @pytest.fixture
    def eos_ids(dg):
        """Sets the model's EOS ids (config.json's and generation_config's) for one test; none by
        default, so that lengths do not depend on whether the tiny model happens to emit one."""
        model = dg[0]
        saved = model.args.eos_token_id, model.generation_config

        def set_eos(ids):
            model.args.eos_token_id = list(ids)
            model.generation_config = dict(saved[1], eos_token_id=list(ids))

        set_eos([])
        yield set_eos
        model.args.eos_token_id, model.generation_config = saved

    return checkpoint, dg, reference, eos_ids


class Draws:
    """One pre-drawn sequence of random draws, consumed in the same order by both sides."""

    def __init__(self, seed, canvases, steps):
        rng = np.random.default_rng(seed)
        self.ids = [rng.integers(0, fx.VOCAB, size=(1, C)) for _ in range(canvases * (steps + 1))]
        self.uniform = [rng.random((1, C), dtype=np.float32) for _ in range(canvases * steps)]

    def engine_noise(self):
        ids, uniform = list(self.ids), list(self.uniform)

        class Noise:
            def ids(self, rows, length, vocab):
                assert len(rows) == 1 and length == C and vocab == fx.VOCAB
                return mx.array(ids.pop(0)).astype(mx.int32)

            def uniform(self, rows, length):
                return mx.array(uniform.pop(0))

        return Noise()

    def patch_torch(self, monkeypatch):
        import torch

        ids, uniform = list(self.ids), list(self.uniform)

        def randint(low, high, size, **kw):
            assert (low, high, tuple(size)) == (0, fx.VOCAB, (1, C))
            return torch.tensor(ids.pop(0))

        def multinomial(probs, num_samples=1, **kw):
            u = torch.tensor(uniform.pop(0)).reshape(-1, 1)
            cdf = probs.float().cumsum(-1)
            sample = (cdf <= u * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
            return sample[:, None]

        monkeypatch.setattr(torch, "randint", randint)
        monkeypatch.setattr(torch, "multinomial", multinomial)


def run_engine(model, prompt, draws, eos, images=None, **settings):
    """The engine's record: per step the canvas fed to the decoder, the accepted positions, the
    argmax canvas and the temperature-scaled logits; and the tokens it returns."""
    spec = model.diffusion_spec
    settings = dict(max_tokens=2 * C, **settings)
    s = resolve_settings(spec, settings, checkpoint_settings(model, spec))
    decoder = make_decoder(model, s, eos, images=images)
    decoder.noise = draws.engine_noise()
    rec = {"input": [], "accept": [], "argmax": [], "processed": []}
    real_decode = model.decode
    real_commit, real_stats = canvas_mod.entropy_commit, canvas_mod.canvas_stats

    def decode(canvas, *a, **k):
        rec["input"].append(np.array(canvas))
        return real_decode(canvas, *a, **k)

    def commit(*a, **k):
        out = real_commit(*a, **k)
        rec["accept"].append(np.array(out))
        return out

    def stats(*a, **k):
        out = real_stats(*a, **k)
        rec["processed"].append(np.array(out.processed))
        return out

    model.decode = decode
    canvas_mod.entropy_commit, canvas_mod.canvas_stats = commit, stats
    tokens, blocks = [], []
    try:
        for event in decoder.run([prompt]):
            if isinstance(event, CanvasStepEvent):
                rec["argmax"].append(np.array(event.generated[:, event.block[0] : event.block[1]]))
            elif isinstance(event, BlockEvent):
                tokens += event.tokens[0]
                blocks.append(event)
    finally:
        del model.decode
        canvas_mod.entropy_commit, canvas_mod.canvas_stats = real_commit, real_stats
    return rec, tokens, blocks


def run_transformers(ref, prompt, draws, eos, monkeypatch, steps=None, **kwargs):
    """transformers' generate, recorded at its sampler and its draft streamer; returns the
    record and the new tokens (with transformers' padding after an EOS)."""
    import torch
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gdg

    rec = {"input": [], "accept": [], "argmax": [], "processed": []}
    accept_canvas = gdg.EntropyBoundSampler.accept_canvas

    def accept(self, current, denoised, logits, step):
        out = accept_canvas(self, current, denoised, logits, step)
        rec["input"].append(current.numpy().copy())
        rec["accept"].append(self.accepted_token_mask.numpy().copy())
        rec["processed"].append(logits.numpy().copy())
        return out

    class Streamer:
        def put(self, value):
            pass

        def put_draft(self, value):
            rec["argmax"].append(value.numpy().copy())

        def end(self):
            pass

    draws.patch_torch(monkeypatch)
    monkeypatch.setattr(gdg.EntropyBoundSampler, "accept_canvas", accept)
    if steps is not None:
        kwargs["max_denoising_steps"] = steps
    out = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=2 * C,
        eos_token_id=list(eos),
        streamer=Streamer(),
        **kwargs,
    )
    monkeypatch.undo()
    return rec, out.sequences[0, len(prompt) :].tolist()


def until_eos(tokens, eos):
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def assert_same_steps(ours, theirs):
    assert len(ours["input"]) == len(theirs["input"]), "different numbers of denoising steps"
    for name in ("input", "accept", "argmax"):
        for step, (a, b) in enumerate(zip(ours[name], theirs[name])):
            assert np.array_equal(a, b), f"{name} differs at step {step}"
