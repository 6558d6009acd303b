"""One door for the numeric arguments of every public API: timeouts, ttls, sizes, counts, indices.

Every memsem call that takes a number of seconds, bytes, elements, tiles or rows passes it through
one of these functions, so one rule holds everywhere:

* ``bool`` is never a number (``True`` is not 1 second or 1 byte): TypeError.
* numbers are ``int``/``float`` or numpy scalars; anything else is a TypeError naming the argument.
* timeouts are finite seconds in ``[0, MAX_WAIT_S]`` (0 means "do not block"; NaN, infinities and
  negative values are ValueError: every wait in memsem is bounded). ``positive=True`` also refuses 0.
* ttls are ``None`` (held until released) or finite seconds in ``(0, MAX_TTL_S]``.
* counts/sizes are integers (an integral float is not accepted either) within the stated bounds.

The errors name the argument and repeat the value, e.g.
``ValueError: timeout must be a finite number of seconds in [0, 2592000], got nan``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

#: the longest wait memsem accepts (seconds): 30 days. Larger values are refused rather than
#: silently treated as "forever" (every wait is bounded) or overflowing a C timespec.
MAX_WAIT_S = 30 * 86400.0
#: the longest finite lease ttl (seconds): expiries are 64-bit nanosecond clock values.
MAX_TTL_S = 1e9
#: the default bound of every blocking call of a runtime, its engines and its handles (seconds);
#: a Runtime's ``timeout=`` replaces it for everything that runtime does
DEFAULT_TIMEOUT_S = 30.0

#: the largest byte count memsem accepts for one window or allocation (64-bit offsets, signed)
MAX_BYTES = (1 << 63) - 1
#: the most dimensions a shape may have (numpy's own limit, and the wire format's u8 ndim)
MAX_NDIM = 64
#: the largest version a window has (2**48 - 1; native ``MEMSEM_VERSION_MAX``: a native result
#: word carries a version in 48 bits, a slot's sequence word holds ``version << 1``)
VERSION_MAX = (1 << 48) - 1

#: the longest window name (bytes of its UTF-8 encoding): what every directory stores whole
NAME_MAX_BYTES = 255

__all__ = ["MAX_WAIT_S", "MAX_TTL_S", "DEFAULT_TIMEOUT_S", "MAX_BYTES", "MAX_NDIM", "NAME_MAX_BYTES", "VERSION_MAX",
           "timeout", "timeout_or", "ttl", "count", "index", "shape", "version", "window_name"]


def _real(value: Any, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return float(value)


def timeout(value: Any, name: str = "timeout", *, positive: bool = False) -> float:
    """A bounded wait in seconds.

    Args:
        value: the caller's argument.
        name: the argument's name, for the error message.
        positive: refuse 0 as well (for defaults that must allow some waiting).

    Returns:
        ``float(value)``.

    Raises:
        TypeError: not a real number (``bool`` included).
        ValueError: NaN, infinite, negative, larger than ``MAX_WAIT_S``, or 0 when ``positive``.
    """
    v = _real(value, name, "a number of seconds")
    lo = "(0" if positive else "[0"
    if not (math.isfinite(v) and 0.0 <= v <= MAX_WAIT_S) or (positive and v == 0.0):
        raise ValueError(f"{name} must be a finite number of seconds in {lo}, {MAX_WAIT_S:g}], "
                         f"got {value!r}")
    return v


def timeout_or(value: Any, default: float, name: str = "timeout") -> float:
    """``timeout(value)``, or ``default`` when ``value`` is None (the runtime's own bound)."""
    return float(default) if value is None else timeout(value, name)


def ttl(value: Any, name: str = "ttl") -> float | None:
    """A lease lifetime: None (until released; reaped if the holder dies) or seconds in
    ``(0, MAX_TTL_S]``.

    Raises:
        TypeError: not None and not a real number. ValueError: NaN, infinite, <= 0 or too large.
    """
    if value is None:
        return None
    v = _real(value, name, "a number of seconds or None (held until released)")
    if not (math.isfinite(v) and 0.0 < v <= MAX_TTL_S):
        raise ValueError(f"{name} must be a finite number of seconds in (0, {MAX_TTL_S:g}], or None "
                         f"(held until released), got {value!r}")
    return v


def count(value: Any, name: str, *, minimum: int = 0, maximum: int | None = None,
          unit: str = "") -> int:
    """An integer size or count (bytes, elements, tiles, rows, slots, workers).

    Args:
        value: the caller's argument (``int`` or a numpy integer; not ``bool``, not a float).
        name: the argument's name. minimum / maximum: inclusive bounds. unit: "bytes", "rows"...
            for the message.

    Raises:
        TypeError: not an integer. ValueError: outside the bounds.
    """
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int{' (' + unit + ')' if unit else ''}, got {value!r} "
                        f"({type(value).__name__})")
    v = int(value)
    if v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {rng}{' ' + unit if unit else ''}, got {value!r}")
    return v


def index(value: Any, name: str, n: int, *, of: str = "") -> int:
    """An index in ``[0, n)``. ``of`` names what is indexed, for the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int in [0, {n}){' for ' + of if of else ''}, got {value!r}")
    v = int(value)
    if not 0 <= v < n:
        raise ValueError(f"{name} must be an int in [0, {n}){' for ' + of if of else ''}, got {value!r}")
    return v


def shape(value: Any, name: str = "shape", *, itemsize: int = 1) -> tuple[int, ...]:
    """An element shape: an int (1-d) or a sequence of ints, each >= 0, at most ``MAX_NDIM``
    dimensions, whose product times ``itemsize`` bytes fits ``MAX_BYTES``.

    Raises:
        TypeError: not an int or a sequence of ints (``bool`` and floats included); the message
            names the offending dimension (``shape[1]``).
        ValueError: a negative dimension, too many dimensions, or more than ``MAX_BYTES`` bytes.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        dims: tuple[Any, ...] = (value,)
    elif isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {value!r} ({type(value).__name__})")
    else:
        dims = tuple(value)
    if len(dims) > MAX_NDIM:
        raise ValueError(f"{name} must have at most {MAX_NDIM} dimensions, got {len(dims)}")
    out = tuple(count(d, f"{name}[{i}]" if not isinstance(value, numbers.Integral) else name, unit="elements")
                for i, d in enumerate(dims))
    total = itemsize
    for d in out:
        total *= d
    if total > MAX_BYTES:
        raise ValueError(f"{name} {out} x {itemsize} bytes per element is {total} bytes, more than "
                         f"{MAX_BYTES}")
    return out


def version(value: Any, name: str = "version") -> int:
    """A version of a window's bytes: 0 (the latest committed one) or a version in
    ``[1, VERSION_MAX]``. The one door of every call that takes a version (get, load, pin,
    stream, gather, wait_version, leases): a version beyond the range a window can hold is
    refused here, never wrapped or truncated on its way to the native bracket.

    Raises:
        TypeError: not an integer (``bool``, floats and strings included).
        ValueError: negative, or larger than ``VERSION_MAX``.
    """
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int in [0, {VERSION_MAX}] (0: the latest), got {value!r} "
                        f"({type(value).__name__})")
    v = int(value)
    if not 0 <= v <= VERSION_MAX:
        raise ValueError(f"{name} must be an int in [0, {VERSION_MAX}] (0: the latest; a window holds at "
                         f"most {VERSION_MAX} versions), got {value!r}")
    return v


def window_name(value: Any, name: str = "name") -> str:
    """A window name: a non-empty ``str`` of at most ``NAME_MAX_BYTES`` (255) bytes of UTF-8,
    without control characters. The one door of every call that takes a name (publish, lookup,
    state dicts, followers), so what publish accepts works in every directory, and what it
    refuses is refused before anything is created.

    Raises:
        TypeError: not a ``str``.
        ValueError: empty, not encodable as UTF-8 (a lone surrogate), longer than
            ``NAME_MAX_BYTES`` bytes, or holding a control character (``\\x00``-``\\x1f``, ``\\x7f``).
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str (a window name), got {value!r:.80} ({type(value).__name__})")
    if not value:
        raise ValueError(f"{name} must be a non-empty str of at most {NAME_MAX_BYTES} bytes of UTF-8, got ''")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid UTF-8 text (it holds a lone surrogate), got {value!r:.80}") from None
    if n > NAME_MAX_BYTES:
        raise ValueError(f"{name} must be at most {NAME_MAX_BYTES} bytes of UTF-8 (NAME_MAX_BYTES), got "
                         f"{len(value)} characters of {n} bytes ({value[:24]!r}...)")
    if any(c < " " or c == "\x7f" for c in value):
        raise ValueError(f"{name} must not hold control characters, got {value!r:.80}")
    return value
