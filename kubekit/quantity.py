"""Kubernetes resource quantities ("100m", "1.5Gi", "2e3") as exact fractions."""

from __future__ import annotations

import functools
import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Fraction | int] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_PATTERN = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$"
)


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


# Few distinct quantities recur across every pod a cluster holds ("500m", "1Gi"), and the
# estimator parses each pod it is asked about: parsed once, kept (Fractions are immutable).
@functools.lru_cache(maxsize=4096)
def parse_quantity(text: str | int | float) -> Fraction:
    if isinstance(text, int | float):
        return Fraction(text)
    match = _PATTERN.match(text.strip())
    if match is None:
        raise QuantityError(f"invalid quantity {text!r}")
    number, exponent, suffix = match.groups()
    value = Fraction(number)
    if exponent:
        return value * Fraction(10) ** int(exponent[1:])
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    return value * Fraction(_DECIMAL[suffix or ""])


def format_quantity(value: Fraction, resource: str = "") -> str:
    """Canonical text for a quantity: whole numbers plain, fractions in milli-units
    (rounded up, as the apiserver does), memory-like values in the largest exact
    binary unit."""
    if value < 0:
        raise QuantityError(f"negative quantity {value} for {resource or 'a resource'}")
    if value.denominator == 1:
        whole = int(value)
        if resource in {"memory", "ephemeral-storage"} or resource.startswith("hugepages-"):
            for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
                if whole and whole % _BINARY[suffix] == 0:
                    return f"{whole // _BINARY[suffix]}{suffix}"
        return str(whole)
    milli = -((-value * 1000) // 1)  # ceiling
    return f"{milli}m"
