"""Tables of a hyperparameter file's contents, as ``fit`` reports and ``show`` prints them."""

from __future__ import annotations

import math


from kvprof.cli.output import first_rows, percent, table


def horizons(hp) -> str:
    """The fitted horizon and wa's tuned ones, each named for what it is (a server runs a tuned one)."""
    text = f"fitted horizon {hp.horizon:g} s"
    tuned = sorted({entry["horizon_s"] for entry in hp.tuning})
    if tuned:
        span = f"{tuned[0]:g}" if len(tuned) == 1 else f"{tuned[0]:g} to {tuned[-1]:g}"
        text += f", wa's tuned horizon {span} s"
    return text


def next_turn_line(hp) -> str | None:
    """What the fit window's next-turn counts say and which candidates ``wa`` takes from them (None: not counted)."""
    from kvprof.models.next_turn import FIRST_TURN_RATIO, MIN_FOLLOWED, MIN_REQUESTS

    counts = hp.next_turn
    if counts is None:
        return None
    rates = [f"{followed / requests:.1%} of {requests:,} that {kind}" if requests else f"none {kind}"
             for kind, requests, followed in (("began a session", counts.began, counts.began_followed),
                                              ("continued one", counts.continued, counts.continued_followed))]
    if counts.favours_first_turn():
        verdict = f"ratio {counts.ratio:.1f} >= {FIRST_TURN_RATIO:g}: wa runs over first-turn and lru"
    elif not counts.enough():
        verdict = (f"fewer than {MIN_REQUESTS} requests or {MIN_FOLLOWED} followed of one kind: too few for a ratio, "
                   f"wa keeps its default candidates")
    else:
        verdict = f"ratio {counts.ratio:.1f} < {FIRST_TURN_RATIO:g}: wa keeps its default candidates"
    return f"next request of the session within {counts.horizon_s:g} s: {rates[0]}, {rates[1]} ({verdict})"


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _mean_time(lam: float | None) -> float | None:
    """1/λ, the mean reuse time in seconds, which reads better than a rate."""
    return 1 / lam if lam else None


def _components(row) -> str:
    """Mixture components as mean gap (weight): ``2.1 s (62%), 140 s (38%)``."""
    return ", ".join(f"{1 / rate:.3g} s ({weight:.0%})" if rate > 0 else f"never ({weight:.0%})"
                     for weight, rate in zip(row.weights, row.rates))


def cells_table(hp, title: str):
    """Per cell and reuse tier: data, the mixture, KS, and held-out quality beside one exponential's."""
    from kvprof.cells import TIER_EDGES

    cells, more = first_rows(list(zip(hp.cell_names(), hp.cell_models())), "cells", len(TIER_EDGES))
    out = table(f"{title}: wa's cells x reuse tiers (held-out log-loss / Brier: mixture vs one exponential)",
                {column: "left" if column in ("cell", "components", "source") else "right"
                 for column in ("cell", "tier", "accesses", "reuses", "p", "components", "KS", "log-loss", "Brier",
                                "source")}, caption=more)
    labels = [f"{edge}" if i + 1 == len(TIER_EDGES) or TIER_EDGES[i + 1] == edge + 1 else f"{edge}-{TIER_EDGES[i + 1] - 1}"
              for i, edge in enumerate(TIER_EDGES)]
    labels[-1] += "+"
    for name, tiers in cells:
        for tier, row in enumerate(tiers):
            diag = row.diagnostics or {}
            held = diag.get("holdout") or {}
            single = held.get("single") or {}
            out.add_row(
                name if tier == 0 else "", f"{labels[tier]} hits",
                fmt(diag.get("n_accesses"), ",d"), fmt(diag.get("n_reuses"), ",d"),
                fmt(row.p, ".3f"), _components(row), fmt(diag.get("ks"), ".3f"),
                f"{fmt(held.get('log_loss'), '.3f')} / {fmt(single.get('log_loss'), '.3f')}" if held else "-",
                f"{fmt(held.get('brier'), '.3f')} / {fmt(single.get('brier'), '.3f')}" if held else "-",
                row.source,
                end_section=tier == len(tiers) - 1,
            )
    return out


def tuning_table(hp, learn_asked: bool = False):
    entries, more = first_rows(list(hp.tuning), "capacities")
    # the finish-reason column only where the window's requests carried finish codes
    codes = any("finish_reason_hit_ratio" in entry.get("measured", {}) or "finish_reason" in entry for entry in entries)
    out = table("tuned on the fit window (wa's token hit ratio per horizon H; wa's horizon: the one a server runs "
                "at that size; start: best shadow; long-output: the candidate's limit in output tokens, and its hit ratio "
                "alone per limit tried vs LRU's; "
                + ("finish-reason: carried or off, its hit ratio alone vs LRU's; " if codes else "")
                + "learned: accesses whose block Belady kept to its next use, and "
                "the predictor's held-out log-loss vs the base rate's, accuracy)",
                {"capacity": "right", "hit ratio by H": "left", "wa's horizon (s)": "right", "start": "left",
                 "long-output": "left", **({"finish-reason": "left"} if codes else {}), "learned": "left"}, caption=more)
    first_turn = hp.next_turn is not None and hp.next_turn.favours_first_turn()
    for entry in entries:
        tried = entry.get("measured", {}).get("hit_ratio_by_horizon_s", {})
        out.add_row(f"{entry['capacity']:,}", ", ".join(f"{h} s: {r:.4f}" for h, r in tried.items()),
                    f"{entry['horizon_s']:g}", entry["start"], _long_output_text(entry),
                    *([_finish_reason_text(entry)] if codes else []),
                    NOT_TRAINED if first_turn and learn_asked else _learned_text(entry.get("learned"), learn_asked))
    return out


def _long_output_text(entry: dict) -> str:
    """The long-output candidate's limit (or "off") and what the tuning measured of it ("-": not tuned)."""
    measured = entry.get("measured", {})
    by_limit = measured.get("hit_ratio_by_output_limit")
    limit = entry.get("long_output_tokens")
    if by_limit is None:
        return "-" if limit is None else f"{limit:g} tokens"
    tried = ", ".join(f"{name}: {ratio:.4f}" for name, ratio in by_limit.items())
    lru = measured.get("lru_hit_ratio")
    return (f"{limit:g} tokens" if limit is not None else "off") + f" ({tried}; lru {fmt(lru, '.4f')})"


def _finish_reason_text(entry: dict) -> str:
    """Whether ``wa`` carries the finish-reason candidate and what the tuning measured of it ("-": not tuned)."""
    measured = entry.get("measured", {})
    alone = measured.get("finish_reason_hit_ratio")
    carried = "carried" if entry.get("finish_reason") else "off"
    if alone is None:
        return carried if entry.get("finish_reason") else "-"
    return f"{carried} ({alone:.4f}; lru {fmt(measured.get('lru_hit_ratio'), '.4f')})"


#: Why ``fit --learned`` learned nothing at a capacity (:func:`kvprof.sim.learn.fit_learned`).
NOTHING_TO_LEARN = ("none: Belady kept all or none of the blocks on this window, or it had none (one label, "
                    "nothing to learn); "
                    "wa starts on its best shadow")


#: Why ``fit --learned`` trained nothing where the next-turn counts choose ``wa``'s candidates.
NOT_TRAINED = "not trained: the next-turn counts put wa over first-turn and lru (no predictor)"


def _learned_text(model, asked: bool = False) -> str:
    """The learned predictor's labels and held-out quality in one cell ("-": none asked for)."""
    if model is None:
        return NOTHING_TO_LEARN if asked else "-"
    quality = model.quality
    text = f"{quality.get('friendly_share', math.nan):.1%} of {quality.get('n_frees', 0):,} kept"
    if "holdout_log_loss" in quality:
        text += (f"; log-loss {quality['holdout_log_loss']:.3f} vs {quality['holdout_base_log_loss']:.3f}, "
                 f"accuracy {quality['holdout_accuracy']:.1%} (base rate {quality['holdout_base_rate']:.1%}) on "
                 + ("the next window" if quality.get("holdout_window") else "the last third"))
    return text


def classes_table(hp, title: str):
    rows, more = first_rows(list(hp.classes.items()) + [("(default)", hp.default)], "classes")
    out = table(title, {column: "left" if column in ("class", "source") else "right"
                        for column in ("class", "accesses", "reuses", "censored", "p", "1/λ (s)", "naive p",
                                       "naive 1/λ", "KS", "median gap (s)", "source")}, caption=more)
    for name, params in rows:
        diag = params.diagnostics or {}
        naive = params.naive or {}
        out.add_row(
            name,
            fmt(diag.get("n_accesses"), "d"),
            fmt(diag.get("n_reuses"), "d"),
            fmt(diag.get("n_censored"), "d"),
            fmt(params.p, ".3f"),
            fmt(_mean_time(params.lam)),
            fmt(naive.get("p"), ".3f"),
            fmt(_mean_time(naive.get("lambda"))),
            fmt(diag.get("ks"), ".3f"),
            fmt(diag.get("median_gap_s"), ".3g"),
            params.source,
        )
    return out


#: What each hint kind's rows are taken over, as a retention table says it.
_AFTER = {"tool_call": "a tool call", "end_turn": "an end of turn", "any": "any request"}


def _wait(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.4g} s"


def retention_table(hp):
    """Per class (all classes pooled first) and hint kind: the requests, the share of their sessions that
    came back, and the wait that catches each share of those returns."""
    retention = hp.retention
    shares = [percent(share, retention.shares) for share in retention.shares]
    rows, more = first_rows([("(all classes)", retention.default), *sorted(retention.classes.items())], "classes",
                            len(_AFTER))
    out = table(f"retention to ask for (docs/hints.md): the wait from a request's {retention.basis} that catches a "
                f"share of its session's returns", {"class": "left", "after": "left", "requests": "right",
                                                     "returned": "right", "share returned": "right",
                                                     **{f"{share} of returns": "right" for share in shares}},
                caption=more)
    for name, kinds in rows:
        shown = [(kind, kinds[kind]) for kind in _AFTER if kind in kinds]
        for i, (kind, row) in enumerate(shown):
            out.add_row(name if i == 0 else "", _AFTER[kind], f"{row.requests:,}", f"{row.returned:,}",
                        f"{row.share_returned:.1%}", *map(_wait, row.seconds), end_section=i == len(shown) - 1)
    return out


def retention_line(hp, share: float = 0.9) -> str | None:
    """The pooled retention for ``share`` of the returns (or the file's nearest share) after each hint kind,
    in one line; None where the file has no retention figures."""
    retention = hp.retention
    if retention is None:
        return None
    at = min(range(len(retention.shares)), key=lambda i: abs(retention.shares[i] - share))
    kinds = [f"after {_AFTER[kind]} {_wait(row.seconds[at])} ({percent(row.share_returned)} of {row.requests:,} "
             f"came back)" for kind, row in retention.default.items()]
    return (f"retention catching {percent(retention.shares[at], retention.shares)} of a session's returns, from a "
            f"request's {retention.basis}, all classes: {'; '.join(kinds)} (kvprof show: per class)")
