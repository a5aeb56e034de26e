"""How well a score predicts reuse on traffic it was not fitted on.

A policy asks its model one question about an idle block: will it be reused within H, given
that it has been idle for ``a`` seconds? :func:`score_quality` asks each model that question on
the accesses of a held-out window, at several ages (``QUALITY_AGES`` horizons: just freed, one
horizon idle, four), and scores the answers with scikit-learn's log-loss and Brier score. An
access enters at age ``a`` when it is still idle then and the window shows what happened in the
next H seconds (reused, or seen idle through ``a + H``).
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import brier_score_loss, log_loss

from kvprof.models.score import mixture_reuse_probability
from kvprof.profiler.reuse import ReuseSamples

#: Ages, in horizons, at which a score is asked to predict a reuse within the horizon.
QUALITY_AGES = (0.0, 1.0, 4.0)
#: Predictions are clipped this far from 0 and 1 before the log-loss (a model that says 0 and is
#: wrong would otherwise score infinity).
_CLIP = 1e-6


def labelled_questions(samples: ReuseSamples, horizon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (sample, age, answer) triples of :data:`QUALITY_AGES` whose answer the window shows.

    Returns
    -------
    sample : int64 array, shape (q,)
        Index into ``samples``.
    age : float64 array, shape (q,), s
    reused : bool array, shape (q,)
        Whether the block came back within ``horizon`` after that age.
    """
    picks, ages, answers = [], [], []
    for factor in QUALITY_AGES:
        age = factor * horizon
        still_idle = samples.time > age
        known = still_idle & ((~samples.censored) | (samples.time >= age + horizon))
        rows = np.flatnonzero(known)
        picks.append(rows)
        ages.append(np.full(rows.size, age))
        answers.append((~samples.censored[rows]) & (samples.time[rows] <= age + horizon))
    return np.concatenate(picks), np.concatenate(ages), np.concatenate(answers)


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
    sample, age, answer = labelled_questions(samples, horizon)
    rows_of = row[sample]
    predictions = {
        name: np.clip(mixture_reuse_probability(p[rows_of], weights[rows_of], rates[rows_of], age, horizon), _CLIP, 1 - _CLIP)
        for name, (p, weights, rates) in models.items()
    }
    out = {"rows": {}, "all": {name: _metrics(answer, pred) for name, pred in predictions.items()} if answer.size else {}}
    for r in np.unique(rows_of).tolist():
        mask = rows_of == r
        out["rows"][r] = {name: _metrics(answer[mask], pred[mask]) for name, pred in predictions.items()}
    return out


def _metrics(answer: np.ndarray, prediction: np.ndarray) -> dict:
    return {"log_loss": float(log_loss(answer, prediction, labels=[False, True])),
            "brier": float(brier_score_loss(answer, prediction, pos_label=True)),
            "n": int(answer.size)}


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
    held = ReuseSamples(*(getattr(held, f)[known] for f in ("time", "censored", "workload", "request", "prior")),
                        n_merged=held.n_merged)

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
