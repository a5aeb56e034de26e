"""What a number kvprof is given may be, and the one way a number is read from text.

Every number a person or a file gives kvprof (an option, a label of a server's ``/metrics``, a
value of an hp or cost file) is checked against a :class:`Bound` before any work, so what is
accepted is what the code downstream can compute with: whole numbers fit in 64 bits (numpy's
int64) or less where a quantity needs less, floats are finite and bounded where a larger one
would overflow later (a horizon times four, a timeout in C's timeval, arrivals divided by a rate
scale).

Text is read strictly (:meth:`Bound.parse`): ASCII digits, an optional sign, and for floats a
decimal point and exponent. Python's ``int`` and ``float`` also take ``6_4``, `` 64 ``,
Arabic-Indic or full-width digits, ``inf`` and ``nan``; none of these is a number here.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

#: Largest integer kvprof stores (numpy int64).
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
#: The most bytes kvprof reads of one JSON input (an hp, cost, results or recording file): 64 MiB, far
#: more than any such file holds (an hp file of thousands of cells is a few MB), so that a wrong path
#: (``/dev/zero``, a FIFO that never ends, a trace given as ``--config``) fails with a message instead
#: of reading until memory runs out. :func:`kvprof.jsonfile.read_bounded` reads one byte more, no more.
MAX_JSON_BYTES = 64 * 2**20

_WHOLE_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
#: Longer texts are not read (Python refuses ints of more than 4300 digits, and no bound needs them).
_MAX_TEXT = 400


@dataclass(frozen=True)
class Bound:
    """The values one quantity may take: whole numbers or finite floats from ``low`` to ``high``.

    ``low_open`` excludes ``low`` itself (``> 0`` rather than ``>= 0``). Invariant: a value
    :meth:`check` accepts is an ``int`` (``whole``) or a finite ``float``/``int``, inside the
    bounds; nothing else passes, booleans included.
    """

    low: float
    high: float
    whole: bool = False
    low_open: bool = False

    def describe(self) -> str:
        """The rule in words: ``an integer from 1 to 16777216``, ``a finite number > 0 and <= 1e+06``."""
        kind = "an integer" if self.whole else "a finite number"
        shown = str if self.whole else _exactly
        top = shown(self.high) if self.whole or self.high < math.inf else None
        if self.low == -math.inf:
            return f"{kind} <= {top}" if top else kind
        if self.low_open:
            return f"{kind} > {shown(self.low)}" + (f" and <= {top}" if top else "")
        return f"{kind} from {shown(self.low)} to {top}" if top else f"{kind} >= {shown(self.low)}"

    def accepts(self, value) -> bool:
        """Whether ``value`` (already a number) is of the bound's kind and inside it."""
        if type(value) is int:
            # compared exactly: an int beyond any float is still compared right
            inside = (self.low < value if self.low_open else self.low <= value) and value <= self.high
            return inside and (self.whole or abs(value) <= sys.float_info.max)
        if type(value) is float and not self.whole:
            return math.isfinite(value) and (self.low < value if self.low_open else self.low <= value) \
                and value <= self.high
        return False

    def check(self, value, what: str = "the value"):
        """``value`` if :meth:`accepts` it; else ``ValueError`` saying what was expected."""
        if not self.accepts(value):
            raise ValueError(f"{what} must be {self.describe()}, got {_shown(value)}")
        return value

    def parse(self, text: str, what: str = "the value"):
        """The number ``text`` spells, checked; ``ValueError`` for anything else (see the module notes)."""
        if type(text) is not str:
            return self.check(text, what)
        pattern = _WHOLE_TEXT if self.whole else _FLOAT_TEXT
        if len(text) > _MAX_TEXT or not pattern.fullmatch(text):
            raise ValueError(f"{what} must be {self.describe()}, written in ASCII digits, got {_shown(text)}")
        if not self.accepts(int(text) if self.whole else float(text)):
            raise ValueError(f"{what} must be {self.describe()}, got {_shown(text)}")
        return int(text) if self.whole else float(text)


def _exactly(number: float) -> str:
    """A bound's number short (``1e+06``) where that is the number, else in full: 1 - 1e-12 is not "1"."""
    short = f"{number:g}"
    return short if float(short) == number else repr(number)


def _shown(value) -> str:
    """A value as a message shows it: text quoted with escapes (so invisible or odd characters show)."""
    if type(value) is str:
        return ascii(value) if len(value) <= 60 else ascii(value[:60]) + "..."
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


# --- the bounds of kvprof's quantities ------------------------------------------------------------

#: Counts: requests, seeds, samples.
COUNT = Bound(0, INT64_MAX, whole=True)
#: Cache capacities in blocks.
BLOCKS = Bound(1, INT64_MAX, whole=True)


def usable_blocks(num_gpu_blocks: int | None) -> int | None:
    """A vLLM server's capacity as kvprof counts it, the blocks its cache can hold: ``num_gpu_blocks``
    less the null block (block 0, which never holds KV), so 0 for a cache of one block; None stays None."""
    return None if num_gpu_blocks is None else num_gpu_blocks - 1
#: Tokens per block (a trace's hash id, an engine block): more than any model's context.
BLOCK_TOKENS = Bound(1, 2**24, whole=True)
#: Token counts of one request or step, and token ids: vLLM keeps them in int32.
TOKENS = Bound(1, INT32_MAX, whole=True)
#: Durations a model or a request is about (horizon, concurrency floor): longer would overflow
#: arithmetic downstream (tuning tries four times the horizon) and means nothing (31 years).
SECONDS = Bound(0.0, 1e9)
POSITIVE_SECONDS = Bound(0.0, 1e9, low_open=True)
#: How long a request may go without progress; C's timeval and thread waits take no more.
TIMEOUT_SECONDS = Bound(0.0, 1e6, low_open=True)
#: Arrivals sped up this many times; beyond these, scheduled times stop being finite or meaningful.
RATE_SCALE = Bound(1e-6, 1e6)
#: Tokens per second a server prefills.
TOKENS_PER_SECOND = Bound(0.0, 1e12, low_open=True)
#: Trace hours synth writes: a week (planning one takes about 2 GB).
HOURS = Bound(0.0, 168.0, low_open=True)
#: A share of a trace's conversations a sampled replay keeps.
SAMPLE_RATE = Bound(0.0, 1.0, low_open=True)
#: Seconds of a window's bounds (either sign: relative windows may count back).
WINDOW_SECONDS = Bound(-1e15, 1e15)
