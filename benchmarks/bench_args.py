"""Argument types the benchmarks share: a value nothing can be measured with is refused by argparse
(exit 2, the option named) before any work, instead of a traceback after minutes of it.

Numbers are read as kvprof's options are (:meth:`kvprof.limits.Bound.parse`: ASCII digits, finite,
inside the bounds), so ``nan``, ``inf`` and out-of-range values never reach a benchmark.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from kvprof.limits import INT64_MAX, Bound

#: joblib's worker count: any integer but 0 (-1 every core, -2 all but one).
JOBS = Bound(-INT64_MAX, INT64_MAX, whole=True)


def bounded(bound: Bound, nonzero: bool = False) -> Callable[[str], int | float]:
    """An argparse ``type=`` reading a number ``bound`` accepts (and not 0 where ``nonzero``)."""

    def parse(text: str):
        try:
            value = bound.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if nonzero and value == 0:
            raise argparse.ArgumentTypeError(f"the value must not be 0, got {text!r}")
        return value

    parse.__name__ = "integer" if bound.whole else "number"  # argparse's name of the value in its messages
    return parse


def case_names(cases: Iterable) -> Callable[[str], str]:
    """An argparse ``type=`` for ``--traces``: comma-separated names each of which starts at least one of
    ``cases``' names (as :func:`bench_quality.chosen_traces` picks them); a name that picks none is refused."""
    names = [case.name for case in cases]

    def parse(text: str) -> str:
        given = text.split(",")
        if "" in given:
            raise argparse.ArgumentTypeError(f"an empty case name in {text!r}")
        unknown = [name for name in given if not any(case.startswith(name) for case in names)]
        if unknown:
            raise argparse.ArgumentTypeError(f"no case is named {', '.join(map(repr, unknown))} (the cases: "
                                             f"{', '.join(names)})")
        return text

    parse.__name__ = "case names"
    return parse
