"""What every family owes a user, one row a family: plain `python -m mlx_lm convert` then plain
`mlx_lm.load` generates what the package does, `Model.shard` over one rank keeps the logits and a
rank count that cannot split the checkpoint is refused, a request through `mlx_dllm serve` answers
what the stream does (structured output included where a row names a pattern), and requests of
different seeds batched by the server's scheduler get the tokens of their single requests.

A family joins by adding a `Family` row; its own file keeps only what is specific to it (forward
and decoding parity with its reference, its recipe, its published config)."""

import dataclasses
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fixtures import bd3lm, build_once, coda, dllm, dllm_qwen2, fast_dllm_v2, open_dcoder, rnd1
from fixtures import dmax as dmax_fixture
from fixtures import gidd as gidd_fixture
from fixtures import idlm as idlm_fixture
from fixtures import llada2 as llada2_fixture
from fixtures import sdar_v as sdar_v_fixture
from fixtures import stable_diffcoder as stable_diffcoder_fixture
from fixtures import wedlm as wedlm_fixture
from helpers import Ranks, assert_close, convert_and_generate, far, load_fixture, serving
from mlx_dllm_models import SettingsError, batch_generate_diffusion, generate_diffusion, load
from mlx_dllm_models import stream_generate_diffusion as stream
from mlx_dllm_models.masks import every_key
from mlx_dllm_models.server import Job, Scheduler
from mlx_dllm_models.spec import (
    BIDIRECTIONAL,
    BLOCK_CAUSAL,
    CAUSAL_PREFIX,
    CAUSAL_WINDOW,
    CLEAN_PREFIX,
)
from reference import (
    coda_torch,
    dllm_a2d,
    gidd_torch,
    idlm_torch,
    open_dcoder_torch,
    rnd1_sampling,
    sdar_v_torch,
    stable_diffcoder_torch,
)

CHAT = [{"role": "user", "content": "hi"}]
QUESTION = "Question: hi\nAnswer:"


@dataclasses.dataclass(frozen=True)
class Serve:
    """One request through the server: `chat` (the messages CHAT) or a completion of `prompt`,
    with `body` as its fields (`extra` the ones the OpenAI client passes as extra_body), answered
    as the stream answers under `want`; `nonempty`: the answer must hold text."""

    body: dict
    want: dict
    prompt: object = None
    extra: dict = dataclasses.field(default_factory=dict)
    nonempty: bool = False

    @property
    def chat(self):
        return self.prompt is None


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's row: its fixture builder (written once a session under the row's name in
    fixture_dir), the model_type a converted config says (`config`: other fields it must hold) and
    the module plain mlx-lm loads (`module`, else the row's name), the prompts and settings of the
    convert parity run (`length`: the exact token count, else some), the ids and forward keywords
    of the one-rank shard check (None: none), its server requests, the prompts of the scheduler's
    batch check (None: none), and its forward's reference (`reference(ckpt, ids, causal=)`: the
    logits, or its body's causal reading, which the family must not match) over canvases of
    `lengths` whose second half is the `mask` id (read as the decoders read it, every key in
    view; `plain_causal`: the plain call, with no mask, is the causal forward upstream's is, else it
    is that same reading); `spec`: fields its DiffusionSpec must hold."""

    build: object
    model_type: str
    module: str | None = None
    config: dict = dataclasses.field(default_factory=dict)
    convert_prompts: list = ((40, 41, 42),)
    convert: dict = dataclasses.field(default_factory=dict)
    length: int | None = None
    shard_ids: list | None = None
    shard_forward: dict = dataclasses.field(default_factory=dict)
    serve: tuple = ()
    structured: str | None = None
    scheduler_prompts: list | None = None
    reference: object = None
    mask: int | None = None
    lengths: tuple = (1, 9, 24)
    plain_causal: bool = False
    spec: dict = dataclasses.field(default_factory=dict)


def masked(mask, seed):
    """Seven prompt ids (drawn with `seed`) then five masks: the canvas the shard check reads."""
    return np.random.default_rng(seed).integers(0, 256, 7).tolist() + [mask] * 5


def spec_facts(family, attention, logit_shift, mask):
    """The DiffusionSpec fields every row states: the family's name, its attention layout, its
    logit shift and mask id."""
    return dict(family=family, attention=attention, logit_shift=logit_shift, mask_token_id=mask)


CHAT_AT_SEED_3 = Serve(
    body=dict(max_tokens=8, seed=3, temperature=0), want=dict(max_tokens=8, seed=3)
)
GREEDY_WEDLM = Serve(
    prompt=QUESTION,
    body=dict(max_tokens=10, temperature=0),
    want=dict(max_tokens=10, temperature=0),
    nonempty=True,
)
SCHEDULER_PROMPTS = [[65, 66, 67], [70, 71, 72, 73, 74, 75, 76]]
TOKEN_PROMPT = Serve(
    prompt=[65, 66, 67], body=dict(max_tokens=8, seed=4), want=dict(max_tokens=8, seed=4)
)

SEEDED = dict(max_tokens=8, steps=4, seed=1)

FAMILIES = {
    "coda": Family(
        coda.build,
        "CoDA",
        convert=SEEDED,
        shard_ids=masked(coda.MASK, 3),
        serve=(CHAT_AT_SEED_3,),
        reference=coda_torch.reference_logits,
        mask=coda.MASK,
        spec=dict(spec_facts("coda", BIDIRECTIONAL, 1, coda.MASK), eos_token_ids=(coda.IM_END,)),
    ),
    "a2d_qwen3": Family(
        dllm.build,
        "a2d-qwen3",
        convert=SEEDED,
        shard_ids=masked(dllm.MASK, 3),
        reference=dllm_a2d.reference_logits,
        mask=dllm.MASK,
        serve=(
            CHAT_AT_SEED_3,
            Serve(
                prompt="hello",
                body=dict(max_tokens=8, seed=3, temperature=0),
                extra={"sampler": "bd3lm", "block_length": 4},
                want=dict(sampler="bd3lm", block_length=4, max_tokens=8, seed=3),
            ),
        ),
    ),
    "a2d_qwen2": Family(
        dllm_qwen2.build,
        "a2d-qwen2",
        convert=dict(max_tokens=8, block_length=4, steps=3, sampler="bd3lm"),
        reference=dllm_a2d.reference_logits,
        mask=dllm.MASK,
        lengths=(1, 11),
    ),
    "rnd1": Family(
        rnd1.build,
        "rnd1",
        convert=dict(max_tokens=8, steps=4),
        shard_ids=masked(rnd1.MASK, 3),
        reference=rnd1_sampling.reference_logits,
        mask=rnd1.MASK,
        spec=dict(spec_facts("rnd1", BIDIRECTIONAL, 1, rnd1.MASK), eos_token_ids=(rnd1.IM_END,)),
        serve=(
            Serve(
                prompt=QUESTION,
                body=dict(max_tokens=8, temperature=0),
                want=dict(max_tokens=8, temperature=0),
            ),
        ),
    ),
    **{
        f"wedlm_{body}": Family(
            build,
            "wedlm",
            module="wedlm",
            convert=dict(max_tokens=12),
            length=12,
            shard_ids=masked(wedlm_fixture.MASK, 3),
            shard_forward={"mask": "causal"},
            serve=(GREEDY_WEDLM,),
            structured="[a-c]{2,4}",
            spec=dict(
                spec_facts("wedlm", CAUSAL_WINDOW, 0, wedlm_fixture.MASK),
                eos_token_ids=(wedlm_fixture.IM_END,),
            ),
        )
        for body, build in (("qwen3", wedlm_fixture.build), ("qwen2", wedlm_fixture.build_qwen2))
    },
    "fast_dllm_v2": Family(
        fast_dllm_v2.build,
        "Fast_dLLM_Qwen",
        module="fast_dllm_qwen",
        config={"bd_size": fast_dllm_v2.BLOCK_SIZE},
        convert_prompts=[list(range(40, 85))],
        convert=dict(max_tokens=40),
        shard_ids=masked(fast_dllm_v2.MASK, 7),
        serve=(
            Serve(
                prompt="Question: what is a block?\nAnswer:",
                body=dict(max_tokens=40, temperature=0),
                want=dict(max_tokens=40, temperature=0),
                nonempty=True,
            ),
        ),
    ),
    "bd3lm": Family(
        bd3lm.build,
        "bd3lm",
        convert_prompts=[""],
        convert=dict(max_tokens=8, seed=1),
        serve=(TOKEN_PROMPT,),
        # "" is BD3-LM's unconditional prompt.
        scheduler_prompts=SCHEDULER_PROMPTS + [[]],
    ),
    "open_dcoder": Family(
        open_dcoder.build_converted,
        "open_dcoder",
        serve=(TOKEN_PROMPT,),
        scheduler_prompts=SCHEDULER_PROMPTS,
        reference=open_dcoder_torch.reference_logits,
        mask=open_dcoder.MASK,
        spec=spec_facts("open_dcoder", BIDIRECTIONAL, 1, open_dcoder.MASK),
        lengths=(1, 11),
        plain_causal=True,
    ),
    # LLaDA2.2: block routing and insert/delete edits at its defaults (tests/test_llada22_*.py
    # compare them with their transcriptions).
    "llada22": Family(
        llada2_fixture.build_22,
        "llada2_moe",
        module="llada2_moe",
        config={"expert_capacity": llada2_fixture.EXPERT_CAPACITY},
        convert=dict(max_tokens=8),
        shard_ids=masked(llada2_fixture.MASK, 3),
        serve=(CHAT_AT_SEED_3, TOKEN_PROMPT),
        scheduler_prompts=SCHEDULER_PROMPTS,
        spec=dict(
            spec_facts("llada2", BLOCK_CAUSAL, 0, llada2_fixture.MASK),
            edit_token_ids=(llada2_fixture.DELETE, llada2_fixture.SPLIT),
        ),
    ),
    "stable_diffcoder": Family(
        stable_diffcoder_fixture.build_converted,
        "stable_diffcoder",
        convert_prompts=[list(range(40, 47))],
        convert=dict(max_tokens=12),
        length=12,
        shard_ids=masked(stable_diffcoder_fixture.MASK, 3),
        shard_forward={"mask": "causal"},
        serve=(CHAT_AT_SEED_3, TOKEN_PROMPT),
        scheduler_prompts=SCHEDULER_PROMPTS,
        reference=stable_diffcoder_torch.reference_logits,
        mask=stable_diffcoder_fixture.MASK,
        spec=dict(
            spec_facts("stable_diffcoder", BLOCK_CAUSAL, 0, stable_diffcoder_fixture.MASK),
            eos_token_ids=(stable_diffcoder_fixture.EOS,),
        ),
        plain_causal=True,
    ),
    "dmax": Family(
        dmax_fixture.build_converted,
        "dmax",
        convert=dict(max_tokens=40),
        length=40,
        shard_ids=masked(dmax_fixture.MASK, 3),
        serve=(CHAT_AT_SEED_3, TOKEN_PROMPT),
        # No scheduler_prompts: its decoding is greedy only, and test_dmax holds a batch's rows
        # to their single runs.
        spec=dict(
            spec_facts("dmax", BLOCK_CAUSAL, 0, dmax_fixture.MASK),
            eos_token_ids=(dmax_fixture.EOS,),
            decoder="dmax",
        ),
    ),
    "gidd": Family(
        gidd_fixture.build,
        "gidd",
        convert=dict(max_tokens=8, block_length=8, steps=8, seed=1),
        shard_ids=masked(gidd_fixture.MASK, 3),
        serve=(TOKEN_PROMPT,),
        # Rows share forwards when their prompts are as long (engine/gidd.py: positions are
        # absolute, the canvas ends at the context).
        scheduler_prompts=[[65, 66, 67], [70, 71, 72]],
        reference=gidd_torch.reference_logits,
        mask=gidd_fixture.MASK,
        spec=dict(
            spec_facts("gidd", CLEAN_PREFIX, 0, gidd_fixture.MASK),
            eos_token_ids=(gidd_fixture.EOS,),
        ),
    ),
    "idlm": Family(
        idlm_fixture.build_converted,
        "idlm",
        convert=dict(max_tokens=24),
        shard_ids=masked(idlm_fixture.MASK, 3),
        serve=(CHAT_AT_SEED_3, TOKEN_PROMPT),
        # No scheduler_prompts: as self-speculation's, its rows draw from one key stream, so
        # requests of different seeds do not share a run; test_idlm holds a batch's rows to their
        # single runs.
        reference=idlm_torch.reference_logits,
        mask=idlm_fixture.MASK,
        spec=dict(
            spec_facts("idlm", CAUSAL_PREFIX, 1, idlm_fixture.MASK),
            eos_token_ids=(idlm_fixture.EOS, idlm_fixture.ENDOFTEXT),
            decoder="idlm",
        ),
        plain_causal=True,
    ),
    # SDAR-VL's text path (its images: tests/test_sdar_v_images.py): SDAR's decoding, its plain call
    # the all-true reading.
    "sdar_v": Family(
        sdar_v_fixture.build_sdar_v,
        "sdar_v",
        convert=dict(max_tokens=8),
        shard_ids=masked(sdar_v_fixture.MASK, 3),
        serve=(CHAT_AT_SEED_3, TOKEN_PROMPT),
        # No scheduler_prompts: its fixture's head is confident enough that a temperature of 2
        # draws the same tokens under any seed; tests/test_sdar_v_images.py holds a batch's rows
        # (with and without images) to their single runs.
        reference=sdar_v_torch.reference_logits,
        mask=sdar_v_fixture.MASK,
        spec=dict(spec_facts("sdar", BLOCK_CAUSAL, 0, sdar_v_fixture.MASK)),
    ),
}


def rows(field):
    """The families whose row sets `field`, as parameters."""
    return [name for name, row in FAMILIES.items() if getattr(row, field)]


@pytest.fixture(scope="module")
def checkpoints(fixture_dir):
    """name -> (row, checkpoint folder, the package's load of it), built on first use."""
    built = {}

    def get(name):
        if name not in built:
            row = FAMILIES[name]
            path = build_once(fixture_dir / name, row.build)
            built[name] = row, path, load(path)
        return built[name]

    return get


@pytest.mark.parametrize("name", rows("spec"))
def test_spec_states_the_family(checkpoints, name):
    _, _, (model, _) = checkpoints(name)
    spec = model.diffusion_spec
    assert {k: getattr(spec, k) for k in FAMILIES[name].spec} == FAMILIES[name].spec


@pytest.mark.parametrize(
    "name, length", [(n, length) for n in rows("reference") for length in FAMILIES[n].lengths]
)
def test_logits_match_the_reference_and_not_the_causal_reading(checkpoints, name, length):
    row, path, _ = checkpoints(name)
    model, _ = load_fixture(path)
    assert type(model).__module__ == f"mlx_dllm_models.models.{row.module or name}"
    ids = np.random.default_rng(length).integers(0, 256, (2, length))
    ids[:, length // 2 :] = row.mask
    every = every_key(length)
    ours = model(mx.array(ids), mask=every)
    assert_close(ours, row.reference(path, ids))
    if length > 1:
        assert far(ours, row.reference(path, ids, causal=True))
    plain = row.reference(path, ids, causal=True) if row.plain_causal else np.array(ours)
    assert_close(model(mx.array(ids)), plain)
    half = max(1, length // 2)
    assert_close(model(mx.array(ids), mask=every, head_span=(0, half)), np.array(ours)[:, :half])


@pytest.mark.slow
@pytest.mark.parametrize("name", rows("convert"))
def test_plain_mlx_lm_convert_and_load(checkpoints, name, tmp_path):
    row, path, (model, tok) = checkpoints(name)
    prompts = [list(p) if not isinstance(p, str) else p for p in row.convert_prompts]
    got = convert_and_generate(path, tmp_path / "mlx", prompts, **row.convert)
    assert got["config"]["model_type"] == row.model_type and "auto_map" not in got["config"]
    for key, value in row.config.items():
        assert got["config"][key] == value, key
    assert got["module"] == f"mlx_dllm_models.models.{row.module or name}"
    want = batch_generate_diffusion(model, tok, prompts, **row.convert).tokens
    assert got["tokens"] == want
    if row.length is None:
        assert len(want[0]) > 0
    else:
        assert len(want[0]) == row.length


@pytest.mark.parametrize("name", rows("shard_ids"))
def test_shard_over_one_rank_keeps_logits_and_three_ranks_are_refused(checkpoints, name):
    row, path, _ = checkpoints(name)
    model, _ = load_fixture(path)
    ids = mx.array([row.shard_ids])
    before = np.array(model(ids, **row.shard_forward))
    model.shard(mx.distributed.init())
    after = np.array(model(ids, **row.shard_forward))
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    refused, _ = load_fixture(path)
    shapes = {k: v.shape for k, v in tree_flatten(refused.parameters())}
    with pytest.raises(SettingsError, match="cannot split the checkpoint over 3 ranks"):
        refused.shard(Ranks(3))
    assert {k: v.shape for k, v in tree_flatten(refused.parameters())} == shapes


def answer(client, name, request):
    """(the server's answer to `request`, the text the stream is given for it)."""
    extra = request.extra or None
    if request.chat:
        got = client.chat.completions.create(
            model=name, messages=CHAT, extra_body=extra, **request.body
        )
        return got.choices[0].message.content, None
    got = client.completions.create(
        model=name, prompt=request.prompt, extra_body=extra, **request.body
    )
    return got.choices[0].text, request.prompt


@pytest.mark.parametrize("name", rows("serve"))
def test_requests_through_serve(checkpoints, name):
    from openai import OpenAI

    from mlx_dllm_models.vision import text_tokenizer

    row, path, (model, tok) = checkpoints(name)
    with serving(path, name) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="x")
        for request in row.serve:
            got, prompt = answer(client, name, request)
            if prompt is None:
                prompt = text_tokenizer(tok).apply_chat_template(
                    CHAT, add_generation_prompt=True, tokenize=False
                )
            want = "".join(r.text for r in stream(model, tok, prompt, **request.want))
            assert got == want == generate_diffusion(model, tok, prompt, **request.want)
            assert want or not request.nonempty
        if row.structured:
            # Constraints reach the decoder through the server's scheduler.
            request = GREEDY_WEDLM
            got = client.completions.create(
                model=name, prompt=QUESTION, extra_body={"regex": row.structured}, **request.body
            )
            want = "".join(
                r.text for r in stream(model, tok, QUESTION, regex=row.structured, **request.want)
            )
            assert re.fullmatch(row.structured, want)
            assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"


def scheduled(model, tok, rows, **settings):
    """Each row's (prompt, seed) as a request of the server's scheduler, all submitted at once:
    (each request's tokens, the most rows a run held)."""
    scheduler = Scheduler(model, tok, max_batch=8)
    jobs = [scheduler.submit(Job(p, dict(settings, max_tokens=8, seed=s))) for p, s in rows]
    while not all(j.done for j in jobs):
        scheduler.step()
    return [j.tokens for j in jobs], scheduler.max_rows


@pytest.mark.parametrize("name", rows("scheduler_prompts"))
def test_concurrent_requests_equal_single_requests(checkpoints, name):
    row, _, (model, tok) = checkpoints(name)
    requests = list(zip(row.scheduler_prompts, [11, 22, 33]))
    together, width = scheduled(model, tok, requests)
    assert width == len(requests), "requests of different seeds did not share a run"
    assert together == [scheduled(model, tok, [r])[0][0] for r in requests]
    assert all(len(t) > 0 for t in together)
    # The draws matter (at temperature 2: a fixture's confident head can hide them at its default).
    first = requests[0][0]
    hot = [scheduled(model, tok, [(first, s)], temperature=2.0)[0][0] for s in (5, 6)]
    assert hot[0] != hot[1], "the seed changes nothing"
