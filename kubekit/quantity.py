"""Kubernetes resource quantities ("100m", "1.5Gi", "2e3") as exact fractions."""

from __future__ import annotations

import decimal
import functools
import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
# The exponent is an int32 to the apiserver: longer ones are not quantities. The digits
# before the point are matched one way only: "\d+\.?\d*" could split them anywhere, and
# a long run of digits before a bad suffix took quadratic time to refuse.
_PATTERN = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([+-]?\d{1,10})|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$"
)
# The apiserver keeps a quantity to the nano, rounding up, and caps binary ones at the
# largest int64; past that no node has room, so every quantity is capped there. Decimal
# arithmetic keeps "1e999999999" as cheap as "1": an exact power of ten that large
# would take the parser hours.
_LARGEST = decimal.Decimal(2**63 - 1)
_NANO = decimal.Decimal("1e-9")
_ARITHMETIC = decimal.Context(
    prec=40, rounding=decimal.ROUND_UP, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN
)


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


# Few distinct quantities recur across every pod a cluster holds ("500m", "1Gi"), and the
# estimator parses each pod it is asked about: parsed once, kept (Fractions are immutable).
@functools.lru_cache(maxsize=4096, typed=True)
def parse_quantity(text: str | int | float) -> Fraction:
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise QuantityError(f"invalid quantity {text!r}")
    # A JSON number reads as its decimal text, as the apiserver reads it ("0.1", not the
    # binary float nearest to it).
    match = _PATTERN.match(str(text).strip())
    if match is None:
        raise QuantityError(f"invalid quantity {text!r}")
    number, exponent, suffix = match.groups()
    value = _ARITHMETIC.create_decimal(number)
    if exponent is not None:
        value = value.scaleb(int(exponent), _ARITHMETIC)
    elif suffix in _BINARY:
        value = _ARITHMETIC.multiply(value, _BINARY[suffix])
    else:
        value = value.scaleb(_DECIMAL[suffix or ""], _ARITHMETIC)
    magnitude = min(value.copy_abs(), _LARGEST)
    if magnitude < _LARGEST:
        magnitude = magnitude.quantize(_NANO, rounding=decimal.ROUND_UP, context=_ARITHMETIC)
    return Fraction(magnitude) if value >= 0 else -Fraction(magnitude)


def format_quantity(value: Fraction, resource: str = "") -> str:
    """A quantity's text as the apiserver writes it back (its canonical form), so that
    what was sent compares equal to what is read: whole numbers with the largest decimal
    suffix that keeps them exact ("1k", "13384M"), fractions in milli-units (rounded up,
    as the apiserver does), memory-like values in the largest exact binary unit."""
    if value < 0:
        raise QuantityError(f"negative quantity {value} for {resource or 'a resource'}")
    milli = -((-value * 1000) // 1)  # ceiling
    if milli % 1000:
        return f"{milli}m"
    whole = milli // 1000
    if resource in {"memory", "ephemeral-storage"} or resource.startswith("hugepages-"):
        for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
            if whole and whole % _BINARY[suffix] == 0:
                return f"{whole // _BINARY[suffix]}{suffix}"
    exponent = 0
    while whole and whole % 1000 == 0 and exponent < 18:
        whole //= 1000
        exponent += 3
    return f"{whole}{_DECIMAL_SUFFIX[exponent]}"
