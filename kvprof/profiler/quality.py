"""How well a score predicts reuse on traffic it was not fitted on.

A policy asks its model one question about an idle block: will it be reused within H, given
that it has been idle for ``a`` seconds? :func:`score_quality` asks each model that question on
the accesses of a held-out window, at several ages (``QUALITY_AGES`` horizons: just freed, one
horizon idle, four), and scores the answers by log-loss and Brier score (scikit-learn's
definitions). An access enters at age ``a`` when it is still idle then and the window shows what
happened in the next H seconds (reused, or seen idle through ``a + H``). A score depends on the
row and the age alone, so the questions are counted per row, age and answer
(:func:`question_counts`) and scored from the counts.
"""

from __future__ import annotations

import numpy as np

from kvprof.models.score import mixture_reuse_probability
from kvprof.profiler.reuse import ReuseSamples

#: Ages, in horizons, at which a score is asked to predict a reuse within the horizon.
QUALITY_AGES = (0.0, 1.0, 4.0)
#: Predictions are clipped this far from 0 and 1 before the log-loss (a model that says 0 and is
#: wrong would otherwise score infinity).
_CLIP = 1e-6


def question_counts(samples: ReuseSamples, row: np.ndarray, n_rows: int, horizon: float) -> np.ndarray:
    """How many questions of :data:`QUALITY_AGES` the window answers, per row, age and answer.

    An access enters at age ``a`` when it is still idle then and the window shows what happened
    in the next ``horizon`` seconds (reused, or seen idle through ``a + horizon``). A score is a
    function of the row and the age alone, so these counts are all that scoring it needs; they
    add up over shards of a trace.

    Parameters
    ----------
    samples : ReuseSamples
    row : int array, shape (m,)
        The model row of each sample, in ``0 .. n_rows - 1``; a negative row leaves the sample out.
    n_rows : int
    horizon : float
        H, seconds.

    Returns
    -------
    int64 array, shape (n_rows, len(QUALITY_AGES), 2)
        ``[r, a, 1]``: questions of row ``r`` at age ``QUALITY_AGES[a] * horizon`` answered
        "reused within H"; ``[r, a, 0]``: answered "not".
    """
    counts = np.zeros((n_rows, len(QUALITY_AGES), 2), dtype=np.int64)
    reused = ~samples.censored
    scored = row >= 0
    for a, factor in enumerate(QUALITY_AGES):
        age = factor * horizon
        known = scored & (samples.time > age) & (reused | (samples.time >= age + horizon))
        answer = reused[known] & (samples.time[known] <= age + horizon)
        counts[:, a, :] = np.bincount(row[known] * 2 + answer, minlength=2 * n_rows).reshape(n_rows, 2)
    return counts


def score_quality(samples: ReuseSamples, row: np.ndarray, models: dict, horizon: float) -> dict:
    """Held-out log-loss and Brier score of each model's reuse score, per row and overall.

    Parameters
    ----------
    samples : ReuseSamples
        Accesses of the held-out window.
    row : int array, shape (m,)
        The model row each sample is scored with.
    models : dict of str to (p, weights, rates)
        Per model name, arrays of shape (rows,), (rows, k), (rows, k).
    horizon : float
        H, seconds.

    Returns
    -------
    dict
        ``{"rows": {row: {model: {"log_loss", "brier", "n"}}}, "all": {model: {...}}}``; rows
        without a question are left out.
    """
    n_rows = len(next(iter(models.values()))[0])
    return score_counts(question_counts(samples, np.asarray(row), n_rows, horizon), models, horizon)


def score_counts(counts: np.ndarray, models: dict, horizon: float) -> dict:
    """:func:`score_quality` from :func:`question_counts` (summed over shards, say).

    Each (row, age) has one prediction per model, so the log-loss and Brier score of its
    questions are its two counts times the loss of that prediction: what scikit-learn's
    ``log_loss`` and ``brier_score_loss`` give on the questions one by one (equal to rounding;
    tested), without materialising them.
    """
    ages = np.asarray(QUALITY_AGES) * horizon
    negatives, positives = counts[..., 0], counts[..., 1]
    per_row = counts.sum(axis=(1, 2))
    losses = {}
    for name, (p, weights, rates) in models.items():
        weights, rates = np.asarray(weights)[:, None, :], np.asarray(rates)[:, None, :]
        prediction = np.clip(mixture_reuse_probability(np.asarray(p)[:, None], weights, rates, ages[None, :], horizon),
                             _CLIP, 1 - _CLIP)
        log_loss = -(positives * np.log(prediction) + negatives * np.log1p(-prediction))
        brier = positives * (1 - prediction) ** 2 + negatives * prediction**2
        losses[name] = (log_loss.sum(axis=1), brier.sum(axis=1))

    def metrics(log_loss: float, brier: float, n: int) -> dict:
        return {"log_loss": float(log_loss / n), "brier": float(brier / n), "n": int(n)}

    total = int(per_row.sum())
    out = {"rows": {}, "all": {name: metrics(ll.sum(), br.sum(), total) for name, (ll, br) in losses.items()}
           if total else {}}
    for r in np.flatnonzero(per_row).tolist():
        out["rows"][r] = {name: metrics(ll[r], br[r], per_row[r]) for name, (ll, br) in losses.items()}
    return out


def class_models(trace, rule, horizon: float, min_gap: float, max_components: int = 3) -> dict:
    """Per class, a mixture and one cure exponential fitted on the window's first half, and how
    each does: KS of the gaps, held-out log-loss and Brier on the second half (``inspect``).

    Returns
    -------
    dict of class name to ``{"mixture": {...}, "single": {...}}``, each with ``p``, ``mean_gaps_s``
    (per component), ``ks`` and ``holdout`` (log_loss, brier, n; None without questions).
    """
    from kvprof.models.mixture import CureMixture, diagnose_mixture
    from kvprof.profiler.classes import classify_trace
    from kvprof.profiler.reuse import extract_reuse

    middle = (trace.first_arrival + trace.censor_time) / 2
    first, second = trace.time_window(None, middle), trace.time_window(middle, None)
    if not (first.n_requests and second.n_requests):
        return {}
    report = {}
    fitted = {}
    codes, names = classify_trace(first, rule)
    samples = extract_reuse(first, codes, min_gap=min_gap)
    for code, name in enumerate(names):
        rows = samples.workload == code
        if not rows.any():
            continue
        fitted[name] = {kind: CureMixture(k).fit(samples.time[rows], samples.censored[rows])
                        for kind, k in (("mixture", max_components), ("single", 1))}
        report[name] = {kind: {"p": model.p_, "mean_gaps_s": [1 / r if r > 0 else None for r in model.rates_],
                               "ks": diagnose_mixture(samples.time[rows], samples.censored[rows], model)["ks"],
                               "holdout": None}
                        for kind, model in fitted[name].items()}
    codes, held_names = classify_trace(second, rule)
    held = extract_reuse(second, codes, min_gap=min_gap)
    index = {name: i for i, name in enumerate(fitted)}
    to_row = np.array([index.get(name, -1) for name in held_names])
    row = to_row[held.workload]
    known = row >= 0
    held = held.subset(known)

    def arrays(kind):
        models = [fitted[name][kind] for name in fitted]
        k = max(m.n_components_ for m in models)
        pad = lambda v: np.pad(v, (0, k - v.size))  # noqa: E731
        return (np.array([m.p_ for m in models]), np.array([pad(m.weights_) for m in models]),
                np.array([pad(m.rates_) for m in models]))

    quality = score_quality(held, row[known], {kind: arrays(kind) for kind in ("mixture", "single")}, horizon)["rows"]
    for name, i in index.items():
        for kind in ("mixture", "single"):
            if i in quality:
                report[name][kind]["holdout"] = quality[i][kind]
    return report
