"""`mlx_dllm chat`: an interactive conversation, as `mlx_lm.chat` has it.

The conversation is kept and the chat template applied to all of it at every turn; the reply's
canvas fills in live on a terminal. `q` or `/exit` ends, `r` or `/reset` starts over, `h` or
`/help` lists the commands (mlx_lm.chat's letters, and the slash forms). Ctrl-C during a reply
stops it and returns to the prompt: the interrupted turn (the question and the partial reply) is
dropped and the conversation before it kept, as after a turn that failed; Ctrl-C (or Ctrl-D) at
the prompt exits.

Images (checkpoints with a vision tower: DiffusionGemma, LLaDA-V, ...): `/image PATH` attaches an
image to the next question (several may be attached), `mlx_dllm chat --image PATH` to the first
one. Each image's placeholder goes before its question's text, as `mlx_dllm generate --image` puts
it, and the conversation keeps its images: every turn's prompt carries all of them, in order.

Lines are read through readline where Python has it (line_editing): the cursor keys, history and
Ctrl-A / Ctrl-E edit the line, and a pasted line arrives whole. Without it a terminal's canonical
mode reads the line, which holds at most 4095 characters (Linux): the rest of a longer line is lost.

Reuse of the previous turns' K/V: block-causal families (SDAR, LLaDA2.x) and the causal-prefix one
(Nemotron) keep the final K/V of a turn (the decoder's `kv_prefix`), and the next turn's prefill
starts after the prefix its prompt shares with them (whole blocks for block-causal families), so a
turn's tokens are those of a fresh run over the whole conversation. Bidirectional families (LLaDA,
Dream) recompute the whole conversation every step anyway: every position attends to every other,
so no K/V outlives a forward. Nemotron's self-speculation and DiffusionGemma's canvas decoder keep no
reusable K/V here either: they recompute the conversation's prefill.
"""

import sys
from typing import Callable, List, Optional

from . import cli_common
from .generate import responses, stats_line
from .prompts import has_chat_template, render_chat
from .request import prepare
from .vision import ImageError, is_processor, read_images, text_tokenizer

HELP = (
    "commands: q or /exit  quit | r or /reset  new conversation | h or /help  this help | "
    "/image PATH  an image for the next question"
)
EXIT = ("q", "/exit", "/quit")
RESET = ("r", "/reset")
HELP_WORDS = ("h", "/help")
IMAGE = "/image"
INTERRUPTED = "[reply interrupted: that turn is dropped, the conversation before it kept]"


class ChatSession:
    """A conversation with a diffusion model: `send(text)` adds a user turn, generates the reply
    (yielding nothing; `on_step` sees the live steps) and keeps both. `reuse_kv=False` recomputes
    the whole conversation at every turn (the reference the reuse must equal)."""

    def __init__(
        self,
        model,
        tokenizer,
        settings: Optional[dict] = None,
        system_prompt: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
        reuse_kv: bool = True,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.text_tokenizer = text_tokenizer(tokenizer)
        if not has_chat_template(tokenizer):
            raise ValueError(
                "this checkpoint's tokenizer has no chat template, so a conversation cannot be "
                "laid out; use `mlx_dllm generate --ignore-chat-template` for raw prompts"
            )
        self.overrides = dict(settings or {})
        self.system_prompt = system_prompt
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.reuse_kv = reuse_kv
        self.reset()

    def reset(self):
        self.messages: List[dict] = []
        self.images: List = []  # the conversation's images, in the order of their placeholders
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})
        self.prior = None  # the last turn's final K/V (cache.PriorKV), where the backend keeps any
        self.reused = 0  # prompt tokens of the last turn whose K/V were reused

    def prompt(self, messages) -> str:
        return render_chat(self.tokenizer, messages, self.template_kwargs)

    def send(self, text: str, on_step: Optional[Callable] = None, on_block=None, images=()):
        """Generate the reply to `text`, asked about `images` (paths, PIL images or arrays; their
        placeholders go before the text); returns (reply text, its token ids, the last
        DiffusionResponse). `on_step(event, decoder)` sees every denoising step, `on_block(text)`
        every committed block's new text. A failure (the conversation outgrew the context, a bad
        setting, an image that cannot be read) leaves the conversation as it was."""
        images = self.check_images(images)
        if images:
            text = self.tokenizer.image_token * len(images) + text
        messages = self.messages + [{"role": "user", "content": text}]
        seen = self.images + images
        request = prepare(
            self.model,
            self.tokenizer,
            [self.prompt(messages)],
            self.overrides,
            images=[seen] if seen else None,
        )
        ids, decoder = request.ids, request.decoder(self.model)
        step = None if on_step is None else (lambda event: on_step(event, decoder))
        reply, tokens, last = "", [], None
        for last in responses(decoder, ids, self.tokenizer, on_step=step, prior=self.prior):
            reply += last.text
            tokens += last.tokens
            if on_block is not None:
                on_block(last.text)
        self.reused = decoder.reused if self.prior is not None else 0
        self.prior = decoder.kv_prefix() if self.reuse_kv else None
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.images = seen
        return reply, tokens, last

    def check_images(self, images) -> List:
        """`images` read (PIL), or a ValueError saying why they cannot be asked about."""
        images = list(images)
        if images and not is_processor(self.tokenizer):
            raise ImageError(
                "this model reads no images (its checkpoint has no vision tower); ask in text only"
            )
        return read_images(images) if images else []


def _parser():
    p = cli_common.Parser(
        prog="mlx_dllm chat",
        description="Chat with a diffusion language model (as mlx_lm.chat). " + HELP,
    )
    cli_common.add_loading_flags(p)
    cli_common.add_template_config_flag(p)
    p.add_argument("--system-prompt", default=None, help="system prompt of the conversation")
    cli_common.add_live_and_image_flags(
        p,
        "an image for the first question (repeatable; checkpoints with a vision tower); "
        "later ones with /image PATH",
    )
    cli_common.add_setting_flags(p)
    return p


def line_editing() -> bool:
    """Let `input()` read lines through readline (GNU readline or libedit), where this Python has
    it: importing the module is what switches input() over. Imported here, not at the top: a
    program that only uses ChatSession keeps its terminal as it was. False without it."""
    try:
        import readline  # noqa: F401
    except ImportError:
        return False
    return True


def chat_main(argv):
    args = _parser().parse_args(argv)
    if args.logprobs is not None:  # a settings-table flag that the REPL would not show
        raise SystemExit(
            "error: --logprobs is not shown by mlx_dllm chat; use mlx_dllm generate --logprobs K, "
            "or mlx_dllm serve (OpenAI's logprobs fields)"
        )
    model, tokenizer = cli_common.load_for_cli(args)
    try:
        session = ChatSession(
            model,
            tokenizer,
            cli_common.chosen_settings(args),
            system_prompt=args.system_prompt,
            chat_template_kwargs=cli_common.template_kwargs(args),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    spec = model.diffusion_spec
    view = cli_common.LiveView(sys.stdout) if sys.stdout.isatty() and not args.no_live else None
    line_editing()
    print(f"[chat with {args.model or 'the embedded model'}] {HELP}", flush=True)
    pending = []  # images for the next question
    for path in args.image or ():
        if not attach(session, path, pending):
            return 1

    def on_step(event, decoder):
        view.draw_step(tokenizer, event, spec.mask_token_id, decoder.eos)

    def on_block(text):
        print(text, end="", flush=True)

    while True:
        try:
            query = input(">> ")
        except (EOFError, KeyboardInterrupt):
            print()
            break
        command = query.strip()
        if command in EXIT:
            break
        if command in RESET:
            session.reset()
            pending.clear()
            print("[conversation reset]", flush=True)
            continue
        if command in HELP_WORDS:
            print(HELP, flush=True)
            continue
        if command == IMAGE or command.startswith(IMAGE + " "):
            attach(session, command[len(IMAGE) :].strip(), pending)
            continue
        if not command:
            continue
        asked = list(pending)  # a turn takes the attached images, whether it succeeds or not
        pending.clear()
        if view is not None:
            view.reset()
        try:
            reply, _, last = session.send(
                query,
                on_step=on_step if view is not None else None,
                on_block=None if view is not None else on_block,
                images=asked,
            )
        except ValueError as e:
            print(f"error: {e}", flush=True)
            continue
        except KeyboardInterrupt:
            print(f"\n{INTERRUPTED}", flush=True)
            continue
        if view is not None:
            view.draw(reply, final=True)
        else:
            print()
        reused = f" | reused K/V: {session.reused} tokens" if session.reused else ""
        print(f"[{stats_line(last)}{reused}]", flush=True)
    print("bye", flush=True)
    return 0


def attach(session: ChatSession, path: str, pending: list) -> bool:
    """`/image PATH`: the image read now (an error line if it cannot be), for the next question."""
    if not path:
        print("error: /image needs a path: /image PATH", flush=True)
        return False
    try:
        pending.extend(session.check_images([path]))
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return False
    print(f"[image attached to the next question: {path}]", flush=True)
    return True
