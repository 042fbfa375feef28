"""The published calls' transcriptions that tests/test_published_calls.py compares with the
package: what each returns (Outcome), and the text families' runs at their published arguments."""

from dataclasses import dataclass


@dataclass
class Outcome:
    tokens: list  # generated, cut before the first EOS
    forwards: int
    window: int  # positions after the prompt that the canvas spans
    repeats: int = 0  # forwards over the same canvas as the forward before (nothing committed)
