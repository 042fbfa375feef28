"""The trace's two pictures, from TraceRecorder.data(): a self-contained HTML page (inline CSS and
JavaScript, the record embedded as JSON; nothing fetched) that replays the canvas with a slider
and a play button, and an SVG still of the order in which the positions were committed."""

import json
from xml.sax.saxutils import escape

# Colour stops of the commitment order (first step dark blue, last yellow: viridis's ends and
# middle), so that the still reads in greyscale too.
ORDER_STOPS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
SVG_COLUMNS = 32
CELL_W, CELL_H = 34, 22


def visible(text: str) -> str:
    """A token's text with line breaks, tabs and other control characters shown as symbols
    (XML cannot carry most of them; a page would show nothing)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\u21b5")
        elif ch == "\t":
            out.append("\u21e5")
        elif ord(ch) < 32 or ord(ch) == 127 or 0xFFFE <= ord(ch) <= 0xFFFF:
            out.append("\u00b7")
        else:
            out.append(ch)
    return "".join(out)


def order_colour(step: int, last: int) -> str:
    """The still's colour of a position committed at `step` of steps 0..last."""
    if step < 0:
        return "#d0d0d0"
    t = step / last if last > 0 else 1.0
    seg = min(int(t * (len(ORDER_STOPS) - 1)), len(ORDER_STOPS) - 2)
    f = t * (len(ORDER_STOPS) - 1) - seg
    a, b = ORDER_STOPS[seg], ORDER_STOPS[seg + 1]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b))


def svg_still(data: dict) -> str:
    """The final canvas, each position coloured by the step that committed its final token (grey:
    never committed), with its token's text and, as a tooltip, the step."""
    order, steps, eos = data["order"], data["steps"], set(data["eos"])
    ids = steps[-1]["ids"] if steps else []
    last = max(len(steps) - 1, 0)
    cols = max(min(SVG_COLUMNS, len(order)), 1)
    rows = (len(order) + cols - 1) // cols
    width, top = cols * CELL_W + 20, 46
    height = top + rows * CELL_H + 44
    t = data["title"]
    head = f"{t['family']} · {t['decoder']} · {len(steps)} steps · {data['nfe']} forwards"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="18" font-size="13">{escape(head)}</text>',
        '<text x="10" y="36" font-size="11" fill="#555">order of commitment '
        "(colour: the step that committed each position; grey: never decoded)</text>",
    ]
    for p, step in enumerate(order):
        x, y = 10 + (p % cols) * CELL_W, top + (p // cols) * CELL_H
        word = ""
        if step >= 0:
            word = "EOS" if ids[p] in eos else visible(data["vocab"].get(str(ids[p]), ""))
        fill = "black" if step > last * 0.6 else "white"  # dark text on the light end
        tip = f"position {p}: step {step + 1}" if step >= 0 else f"position {p}: not committed"
        parts.append(
            f"<g><title>{escape(tip)} {escape(word)}</title>"
            f'<rect x="{x}" y="{y}" width="{CELL_W - 2}" height="{CELL_H - 2}" '
            f'fill="{order_colour(step, last)}"/>'
            f'<text x="{x + 3}" y="{y + 14}" font-size="9" fill="{fill}">{escape(word[:5])}</text>'
            "</g>"
        )
    y = top + rows * CELL_H + 10
    for i in range(cols):
        colour = order_colour(round(i * last / max(cols - 1, 1)), last)
        parts.append(
            f'<rect x="{10 + i * CELL_W}" y="{y}" width="{CELL_W}" height="8" fill="{colour}"/>'
        )
    parts.append(f'<text x="10" y="{y + 24}" font-size="10">step 1</text>')
    parts.append(
        f'<text x="{width - 10}" y="{y + 24}" font-size="10" text-anchor="end">'
        f"step {last + 1}</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def html_page(data: dict) -> str:
    """The replay page: the record as JSON in a script element ('</' escaped, so no token's text
    can end it), the template's code around it."""
    record = json.dumps(data, ensure_ascii=True).replace("</", "<\\/")
    title = escape(f"{data['title']['family']} decoding trace")
    return PAGE.replace("__TITLE__", title).replace("__DATA__", record)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font: 14px/1.4 -apple-system, system-ui, sans-serif; margin: 18px; color: #222; }
h1 { font-size: 17px; margin: 0 0 4px; }
#meta { color: #555; margin-bottom: 10px; }
#prompt { background: #f4f4f4; padding: 6px 8px; border-radius: 4px; white-space: pre-wrap;
  font-family: ui-monospace, monospace; font-size: 12px; max-height: 7em; overflow: auto; }
.image { display: inline-block; background: #8a6d3b; color: white; border-radius: 3px;
  padding: 0 5px; margin: 0 2px; }
#controls { display: flex; align-items: center; gap: 10px; margin: 12px 0; }
#step { flex: 1; }
#counter { font-family: ui-monospace, monospace; min-width: 26em; }
#canvas { display: flex; flex-wrap: wrap; gap: 2px; font-family: ui-monospace, monospace;
  font-size: 12px; }
.cell { white-space: pre; padding: 2px 3px; border-radius: 3px; min-width: 1.2em;
  border: 1px solid transparent; text-align: center; }
.masked { background: #e3e3e3; color: #999; }
.new { border-color: #000; font-weight: bold; }
.edited { border-color: #c00; border-style: dashed; font-weight: bold; }
.remasked { background: #e3e3e3; color: #c00; border-color: #c00; }
.block { box-shadow: 0 2px 0 #36c; }
.eos { opacity: 0.45; }
#legend { margin-top: 12px; color: #555; font-size: 12px; }
#legend span.cell { display: inline-block; margin-right: 4px; }
#text { margin-top: 12px; white-space: pre-wrap; border-top: 1px solid #ddd; padding-top: 8px; }
</style></head>
<body>
<h1>__TITLE__</h1>
<div id="meta"></div>
<div id="prompt"></div>
<div id="controls">
<button id="play" type="button">Play</button>
<input id="step" type="range" min="0" max="0" value="0" aria-label="step">
<span id="counter"></span>
</div>
<div id="canvas"></div>
<div id="legend">
<span class="cell masked">&#9617;</span>to decode
<span class="cell new" style="background:hsl(120,70%,82%)">new</span>committed this step
<span class="cell edited" style="background:hsl(60,70%,82%)">edit</span>edited
<span class="cell remasked">&#9617;</span>re-masked
<span class="cell eos">EOS</span>end of sequence;
colour: confidence at commit (red low, green high; blue: not reported);
underline: the step's block
</div>
<div id="text"></div>
<script type="application/json" id="trace-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("trace-data").textContent);
const slider = document.getElementById("step");
const counter = document.getElementById("counter");
const canvas = document.getElementById("canvas");
const play = document.getElementById("play");
const eos = new Set(D.eos);
const t = D.title;
document.getElementById("meta").textContent = [t.family, t.decoder,
  t.mode ? "mode " + t.mode : null,
  t.sampler ? "sampler " + t.sampler : null, t.steps ? "steps " + t.steps : null,
  t.block_length ? "block_length " + t.block_length : null, "max_tokens " + t.max_tokens,
  D.steps.length + " recorded steps", D.nfe + " forwards"].filter(Boolean).join(" \\u00b7 ");
const prompt = document.getElementById("prompt");
for (const seg of D.prompt) {
  if (seg.image !== undefined) {
    const s = document.createElement("span");
    s.className = "image";
    s.textContent = "[image: " + seg.image + " ids]";
    prompt.appendChild(s);
  } else {
    prompt.appendChild(document.createTextNode(seg.text));
  }
}
document.getElementById("text").textContent = D.text;
function shown(text) {
  return text.replace(/\\n/g, "\\u21b5").replace(/\\t/g, "\\u21e5");
}
function colour(c, kind) {
  if (kind === "masked" || kind === "remasked") return "";
  if (c === null || c === undefined) return "hsl(210,60%,86%)";
  const x = Math.max(0, Math.min(1, c));
  return "hsl(" + Math.round(120 * x) + ",70%,82%)";
}
function draw(i) {
  const s = D.steps[i];
  if (!s) { counter.textContent = "no steps recorded"; return; }
  canvas.textContent = "";
  let done = 0, fresh = 0;
  for (let p = 0; p < s.ids.length; p++) {
    const kind = D.kinds[s.kind[p]];
    const cell = document.createElement("span");
    cell.className = "cell " + kind;
    if (p >= s.block[0] && p < s.block[1]) cell.classList.add("block");
    if (kind === "masked" || kind === "remasked") {
      cell.textContent = "\\u2591";
    } else {
      done++;
      if (kind === "new" || kind === "edited") fresh++;
      const word = D.vocab[String(s.ids[p])] || "?";
      if (eos.has(s.ids[p])) cell.classList.add("eos");
      cell.textContent = eos.has(s.ids[p]) ? "EOS" : shown(word);
      cell.style.background = colour(s.conf[p], kind);
      const c = s.conf[p];
      cell.title = "position " + p + ": " + word +
        (c === null ? "" : ", confidence " + c.toFixed(3));
    }
    canvas.appendChild(cell);
  }
  counter.textContent = "step " + (i + 1) + " / " + D.steps.length + " \\u00b7 forwards " +
    s.nfe + " \\u00b7 block [" + s.block[0] + ", " + s.block[1] + ") \\u00b7 decoded " + done +
    " / " + s.ids.length + " \\u00b7 this step " + fresh;
}
let timer = null;
function stop() { clearInterval(timer); timer = null; play.textContent = "Play"; }
play.addEventListener("click", () => {
  if (timer !== null) { stop(); return; }
  if (Number(slider.value) >= D.steps.length - 1) slider.value = 0;
  play.textContent = "Pause";
  draw(Number(slider.value));
  timer = setInterval(() => {
    const next = Number(slider.value) + 1;
    if (next >= D.steps.length) { stop(); return; }
    slider.value = next;
    draw(next);
  }, Math.max(60, Math.min(400, 8000 / Math.max(D.steps.length, 1))));
});
slider.addEventListener("input", () => draw(Number(slider.value)));
slider.max = Math.max(D.steps.length - 1, 0);
slider.value = slider.max;
draw(Number(slider.value));
</script>
</body></html>
"""


def image_steps_page(prompt: str, frames) -> str:
    """A text-to-image run's trace: a self-contained page of the image decoded after each step
    (`frames`: (step, steps, PNG bytes) in order), the image canvas filling in."""
    import base64

    figures = "".join(
        f'<figure><img alt="step {step}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode("ascii")}"><figcaption>step {step}/{steps}</figcaption>'
        "</figure>"
        for step, steps, png in frames
    )
    style = (
        "body{font-family:sans-serif;margin:1em}figure{display:inline-block;margin:4px}"
        "img{width:192px;image-rendering:pixelated;border:1px solid #ccc}"
        "figcaption{text-align:center;font-size:small}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>image trace</title>"
        f"<style>{style}</style></head><body><h1>{escape(prompt)}</h1>{figures}</body></html>"
    )
