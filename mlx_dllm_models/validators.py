"""The checks and CLI parsers the settings table (settings.SETTINGS) is built from.

A validator takes (name, value) and returns an error message, or None when the value is valid; a
CLI parser turns a flag's text into the value.
"""

import math
from typing import Tuple


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_at_least(least: int, what: str = ""):
    def check(name, v):
        if is_int(v) and v >= least:
            return None
        return f"{name} must be an integer >= {least}{what}, got {v!r}"

    return check


def number(low=None, high=None, low_open=False, high_open=False, what="", finite=False):
    """A number in [low, high] (either end open or absent)."""

    def check(name, v):
        if is_int(v) and abs(v) >= 2**63:
            # Past int64, mlx cannot turn it into an array (a bare "std::bad_cast").
            return f"{name} must be a number below 2**63 in magnitude (a float is fine), got {v!r}"
        ok = is_number(v) and v == v and (not finite or math.isfinite(v))
        ok = ok and (low is None or (v > low if low_open else v >= low))
        ok = ok and (high is None or (v < high if high_open else v <= high))
        if ok:
            return None
        if high is None:
            span = f"a {'finite ' if finite else ''}number {'>' if low_open else '>='} {low}"
        else:
            span = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        return f"{name} must be {span}{what}, got {v!r}"

    return check


def optional(check):
    def optional(name, v):
        return None if v is None else check(name, v)

    optional.options = getattr(check, "options", None)
    return optional


def choice(options: Tuple[str, ...], context: str):
    def check(name, v):
        if v in options:
            return None
        return f"unknown {name} {v!r}{context}; choose one of: {', '.join(options)}"

    # The fixed values, for the CLI's choices (cli_common).
    check.options = options
    return check


def int_in(low: int, high: int, what: str = ""):
    def check(name, v):
        if is_int(v) and low <= v <= high:
            return None
        return f"{name} must be an integer in [{low}, {high}]{what}, got {v!r}"

    return check


def positive_int(name, v):
    return None if is_int(v) and v >= 1 else f"{name} must be a positive integer, got {v!r}"


def seed_value(name, v):
    # mx.random.key takes an unsigned 64-bit seed; outside that range it raises a bare TypeError.
    if is_int(v) and 0 <= v < 2**64:
        return None
    return f"{name} must be an integer in [0, 2**64), got {v!r}"


def true_or_false(name, v):
    return None if isinstance(v, bool) else f"{name} must be true or false, got {v!r}"


def cli_bool(text: str) -> bool:
    """CLI values of on/off settings."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def a_name(name, v):
    # The value is then looked up in a table (the cache backends): a list or a number would fail
    # there with a bare TypeError, or an empty one be read as "auto".
    return None if isinstance(v, str) and v else f"{name} must be a name (a string), got {v!r}"


def cli_optional_float(text: str):
    """CLI values of settings that may be unset: 'none' / 'null' unset them."""
    return None if text.lower() in ("none", "null") else float(text)


# The parsers a setting's CLI flag takes, by the name the CLI's index of the settings table
# (settings_index) records: the parser is rebuilt from the name without importing the table.
CLI_KINDS = {
    "int": int,
    "float": float,
    "str": str,
    "on/off": cli_bool,
    "optional float": cli_optional_float,
}
