"""GPT-2's byte-level alphabet, which byte-level BPE vocabularies (Qwen's, LLaDA's, the tiny
fixtures') spell their tokens in."""

from typing import Dict


def bytes_to_unicode() -> Dict[int, str]:
    """The table from each byte to the printable character that stands for it: printable bytes
    stand for themselves, the others for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table
