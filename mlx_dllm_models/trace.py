"""A picture of the decoding: TraceRecorder follows one prompt's run (its StepEvents and
BlockEvents) and writes a self-contained HTML page that replays the canvas step by step, with an
SVG still of the order in which the positions were committed beside it (trace_page.py draws both).

Each recorded step keeps the row's canvas, which positions are still to decode (masks, or for the
uniform-noise canvas the positions the step did not accept), and the step's confidence where the
decoder reports one. A decoder that yields no StepEvent (self-speculation: each round is a
BlockEvent) gets one step per round, its confirmed tokens followed by the positions still to come.
"""

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .engine import BlockEvent
from .vision import text_tokenizer

# What a position is at a step, against the step before (the page's classes, in this order).
MASKED, KEPT, NEW, EDITED, REMASKED = range(5)
KINDS = ("masked", "kept", "new", "edited", "remasked")


class TraceStep:
    """One recorded step of row 0: forwards so far, the block's span, the canvas, which positions
    are still to decode, and the step's confidence (None for a decoder that reports none)."""

    def __init__(self, nfe, block, ids, masked, confidence=None):
        self.nfe, self.block, self.ids, self.masked = nfe, list(block), ids, masked
        self.confidence = confidence


def image_ids(model, tokenizer) -> tuple:
    """(first id past the text vocabulary, the checkpoint's image token id or None): the ids a
    prompt's images take, shown as one placeholder."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = len(hf)
    except TypeError:
        vocab = getattr(hf, "vocab_size", None)
    args = getattr(model, "args", None)
    image = getattr(args, "image_token_id", None)
    if image is None:
        image = getattr(args, "image_token_index", None)
    return vocab, image


class TraceRecorder:
    """Records one prompt's decoding (row 0 of a run) for `write`.

    `prompt_ids` the prompt as the decoder sees it, `settings` the resolved settings, `decoder`
    the run's decoder (its `eos`), `path` where the page goes (the SVG beside it, `.svg`)."""

    def __init__(self, model, tokenizer, prompt_ids, settings, decoder, path):
        spec = model.diffusion_spec
        self.tokenizer = text_tokenizer(tokenizer)
        self.mask_id = spec.mask_token_id
        self.eos = sorted(getattr(decoder, "eos", ()))
        self.max_tokens = settings.max_tokens
        self.prompt_ids = list(prompt_ids)
        self.path = Path(path)
        self.vocab, self.image_id = image_ids(model, self.tokenizer)
        self.title = {
            "family": getattr(getattr(model, "args", None), "model_type", type(model).__module__),
            "decoder": type(decoder).__name__,
            "mode": settings.mode,
            "sampler": settings.sampler,
            "steps": settings.steps,
            "block_length": settings.block_length,
            "max_tokens": self.max_tokens,
        }
        decoder.step_confidence = True  # the events then carry each step's confidence
        self.steps: List[TraceStep] = []
        self.tokens: List[int] = []
        self.nfe = 0
        self.stepped = False  # a StepEvent since the last BlockEvent

    def event(self, event) -> None:
        """Record a decoder event (only row 0's part)."""
        if 0 not in event.rows:
            return
        row = event.rows.index(0)
        if isinstance(event, BlockEvent):
            new = list(event.tokens[row])
            if not self.stepped:  # a decoder without steps: one step a committed round
                ids = self.tokens + new
                todo = max(self.max_tokens - len(ids), 0)
                span = (len(self.tokens), len(ids))
                filler = [self.mask_id if self.mask_id is not None else -1] * todo
                masked = [False] * len(ids) + [True] * todo
                conf = None
                if event.confidence is not None:
                    conf = [None] * len(self.tokens) + list(event.confidence[row]) + [None] * todo
                self.steps.append(TraceStep(event.nfe, span, ids + filler, masked, conf))
            else:
                self.read_out()
            self.tokens += new
            self.nfe = event.nfe
            self.stepped = False
            return
        ids = [int(t) for t in event.generated[row].tolist()]
        pending = getattr(event, "pending", None)
        pending = pending[row].tolist() if pending is not None else [False] * len(ids)
        masked = [t == self.mask_id or bool(p) for t, p in zip(ids, pending)]
        conf = None
        if event.confidence is not None:
            conf = [None if math.isnan(c) else c for c in event.confidence[row].tolist()]
        self.steps.append(TraceStep(event.nfe, event.block, ids, masked, conf))
        self.nfe = event.nfe
        self.stepped = True

    def read_out(self) -> None:
        """The uniform-noise canvas returns its last argmax whole, accepted or not: a committed
        canvas whose last step left positions pending gets one more step (no forward) with its
        block read out."""
        last = self.steps[-1]
        lo, hi = last.block[0], min(last.block[1], len(last.ids))
        pending = [p for p in range(lo, hi) if last.masked[p] and last.ids[p] != self.mask_id]
        if not pending:
            return
        masked = list(last.masked)
        for p in pending:
            masked[p] = False
        self.steps.append(TraceStep(last.nfe, last.block, last.ids, masked, last.confidence))

    # ---------------------------------------------------------------------------- the record

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def is_image(self, t: int) -> bool:
        return (self.vocab is not None and t >= self.vocab) or t == self.image_id

    def prompt_segments(self) -> List[dict]:
        """The prompt as text runs and image placeholders (a run of image ids is one image)."""
        out, run = [], []
        i, ids = 0, self.prompt_ids
        while i < len(ids):
            if not self.is_image(ids[i]):
                run.append(ids[i])
                i += 1
                continue
            if run:
                out.append({"text": self.text(run)})
                run = []
            j = i
            while j < len(ids) and self.is_image(ids[j]):
                j += 1
            out.append({"image": j - i})
            i = j
        if run:
            out.append({"text": self.text(run)})
        return out

    def data(self) -> dict:
        """The page's record: per step the canvas, each position's kind against the step before
        and the confidence it was last committed with; the final order of commitment."""
        steps, at_commit, order = [], [], []
        prev: Optional[TraceStep] = None
        for n, step in enumerate(self.steps):
            width = len(step.ids)
            at_commit += [None] * (width - len(at_commit))
            order += [-1] * (width - len(order))
            kinds = []
            for p in range(width):
                before = prev is not None and p < len(prev.ids) and not prev.masked[p]
                if step.masked[p]:
                    kind = REMASKED if before else MASKED
                    at_commit[p], order[p] = None, -1
                elif not before:
                    kind = NEW
                elif prev.ids[p] != step.ids[p]:
                    kind = EDITED
                else:
                    kind = KEPT
                if kind in (NEW, EDITED):
                    order[p] = n
                    if step.confidence is not None and p < len(step.confidence):
                        at_commit[p] = step.confidence[p]
                kinds.append(kind)
            steps.append(
                {
                    "nfe": step.nfe,
                    "block": step.block,
                    "ids": step.ids,
                    "kind": kinds,
                    "conf": [None if c is None else round(c, 4) for c in at_commit[:width]],
                }
            )
            prev = step
        shown = {t for s in steps for t, k in zip(s["ids"], s["kind"]) if k != MASKED}
        vocab: Dict[str, str] = {
            str(t): self.text([t]) for t in sorted(shown | set(self.tokens)) if t >= 0
        }
        return {
            "title": self.title,
            "prompt": self.prompt_segments(),
            "eos": self.eos,
            "kinds": list(KINDS),
            "vocab": vocab,
            "steps": steps,
            "order": order,
            "tokens": self.tokens,
            "text": self.text(self.tokens),
            "nfe": self.nfe,
        }

    def write(self) -> tuple:
        """Write the page and the SVG still; returns their paths."""
        from .trace_page import html_page, svg_still

        data = self.data()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        svg = self.path.with_suffix(".svg")
        self.path.write_text(html_page(data), encoding="utf-8")
        svg.write_text(svg_still(data), encoding="utf-8")
        return self.path, svg


def embedded_data(html: str) -> dict:
    """The step record a page embeds (what the tests and other tools read back)."""
    start = html.index('<script type="application/json" id="trace-data">')
    start = html.index(">", start) + 1
    stop = html.index("</script>", start)
    return json.loads(html[start:stop])
