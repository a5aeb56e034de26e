"""Train ``wa``'s ``learned`` candidate on what Belady did with the fit window.

:func:`belady_labels` replays a workload under Belady, compiled, and labels every access by what
Belady did with its block next (Hawkeye's OPT labels, Jain & Lin, ISCA '16, at each access:
:mod:`kvprof.sim.belady_labels`): 1 (cache-friendly) when the next access by a later request
was a hit, Belady having kept the block; 0 (cache-averse) when it missed or there is none. Its
features are those the live pool gives the block at the request's free
(:class:`kvprof.policy.learned.FreeFeatures`), computed on Belady's hits
(:func:`kvprof.sim.free_features.access_features`). :func:`python_free_labels` is the last
round's labeller (Belady on the Python engine, labelled at each free; a free still unresolved
when the replay ends is left out), kept as the reference the access labels are checked against.

:func:`fit_learned` sets the friendly buckets' credit to the :data:`CREDIT_QUANTILE` of the
friendly frees' reuse gaps (seconds from the free to the hit) and fits a logistic regression over the one-hot binned features and returns it
as per-bin weights (:class:`kvprof.models.learned.LearnedModel`), with its log-loss and
accuracy on held-out frees: those of the window after the fit window when given (labelled the
same way), else the last :data:`HOLDOUT_SHARE` of the frees (in time), predicted by a fit on the rest.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from kvprof.models.learned import FEATURES, LOG_BINNED, N_LOG_BINS, LearnedModel
from kvprof.policy.belady import BeladyPolicy
from kvprof.policy.learned import FreeFeatures
from kvprof.profiler.reuse import next_access
from kvprof.sim.belady_labels import belady_hits, labels_from_hits
from kvprof.sim.config import SimConfig
from kvprof.sim.engine import simulate
from kvprof.sim.workload import Workload

#: The latest share of the labelled frees held out to measure the predictor.
HOLDOUT_SHARE = 1 / 3
#: Inverse L2 strength of the logistic regression (scikit-learn's ``C``).
REGULARISATION_C = 1.0
#: Bucket edges of the fitted policy: predicted cache-averse below 1/2, friendly above.
EDGES = (0.5,)
#: The credit of a friendly bucket: this quantile of the gaps after which Belady's kept blocks were reused.
CREDIT_QUANTILE = 0.9


class LabellingBelady(BeladyPolicy):
    """Belady, recording each free's features and, once known, what Belady did with the block.

    Invariant: ``labels[i]`` is -1 while the block of free ``i`` is in ``_pending`` (evictable or
    held, its next access not yet seen), else 1 (its next access hit; ``gaps[i]`` seconds after
    the free) or 0 (evicted first).
    """

    keyed_by = "cell"

    def __init__(self, n_cells: int, n_tiers: int) -> None:
        super().__init__()
        self._features = FreeFeatures(n_cells, n_tiers)
        self.rows: list[tuple[int, int, int, int]] = []
        self.labels: list[int] = []
        self.freed_at: list[float] = []
        self.gaps: list[float] = []
        self._pending: dict[int, int] = {}

    def access(self, block, now, workload=0, depth=0, *, hit=False, next_use=float("inf"), content=None) -> None:
        super().access(block, now, workload, depth, hit=hit, next_use=next_use, content=content)
        self._features.access(block, workload, depth, hit)
        freed = self._pending.pop(block, None)
        if freed is not None:
            self.labels[freed] = 1 if hit else 0
            self.gaps[freed] = now - self.freed_at[freed]

    def free(self, blocks, now) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        for block, features in zip(blocks, self._features.of_free(blocks, now)):
            self._pending[block] = len(self.rows)
            self.rows.append(features)
            self.labels.append(-1)
            self.freed_at.append(now)
            self.gaps.append(float("nan"))
        super().free(blocks, now)

    def evict(self, now) -> int:
        block = super().evict(now)
        freed = self._pending.pop(block, None)
        if freed is not None:
            self.labels[freed] = 0
        return block


def belady_labels(workload: Workload, capacity: int, config: SimConfig, n_cells: int,
                  n_tiers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features (n, 7: :data:`~kvprof.models.learned.FEATURES`), labels (n,) and the friendly ones'
    reuse gaps (n,: seconds from the request to the next one's hit, NaN for the averse) of the
    labelled accesses, in time order, from Belady's compiled replay at ``capacity``. An access whose
    block is not used again is left out when it comes within the :data:`CREDIT_QUANTILE` of the
    friendly gaps of the window's last request (censored: a use may follow the window)."""
    from kvprof.sim.free_features import access_features  # numba is imported only when learning

    hit = belady_hits(workload, capacity, config)
    labels = labels_from_hits(workload, hit).astype(np.int64)
    owner = np.repeat(np.arange(workload.n_requests), np.diff(workload.offsets))
    nxt = next_access(workload.block, owner)
    gaps = np.full(len(labels), np.nan)
    friendly = labels == 1
    at = workload.arrival[owner]
    gaps[friendly] = at[nxt[friendly]] - at[friendly]
    # Censored: no next use seen, but too close to the window's end for the friendly ones' gaps to tell.
    horizon = np.quantile(gaps[friendly], CREDIT_QUANTILE) if friendly.any() else 0.0
    known = (nxt >= 0) | (at <= (at[-1] if len(at) else 0.0) - horizon)
    return access_features(workload, hit, n_cells, n_tiers)[known], labels[known], gaps[known]


def python_free_labels(workload: Workload, capacity: int, config: SimConfig, n_cells: int,
                       n_tiers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The last round's labeller: features (n, 7), labels (n,) and the friendly ones' reuse gaps
    (n,: seconds, NaN for the averse) of the labelled frees, in time order, Belady block by block."""
    policy = LabellingBelady(n_cells, n_tiers)
    simulate(workload, policy, capacity, config, engine="python")
    labels = np.asarray(policy.labels, dtype=np.int64)
    rows = np.asarray(policy.rows, dtype=np.int64).reshape(-1, len(FEATURES))
    known = labels >= 0
    return rows[known], labels[known], np.asarray(policy.gaps, dtype=np.float64)[known]


def _one_hot(rows: np.ndarray, sizes: tuple[int, ...]) -> sp.csr_matrix:
    offsets = np.cumsum((0,) + sizes[:-1])
    columns = (rows + offsets).ravel()
    indptr = np.arange(0, rows.size + 1, rows.shape[1])
    return sp.csr_matrix((np.ones(rows.size), columns, indptr), shape=(rows.shape[0], sum(sizes)))


def _fit(rows: np.ndarray, labels: np.ndarray, sizes: tuple[int, ...]):
    """The regression on the distinct (features, label) pairs weighted by their counts: the same
    fit as on every free, as the features are discrete, in milliseconds instead of seconds."""
    from sklearn.linear_model import LogisticRegression

    pairs, counts = np.unique(np.column_stack([rows, labels]), axis=0, return_counts=True)
    model = LogisticRegression(C=REGULARISATION_C, max_iter=1000)
    model.fit(_one_hot(pairs[:, :-1], sizes), pairs[:, -1], sample_weight=counts)
    return model


def fit_learned(rows: np.ndarray, labels: np.ndarray, n_cells: int, n_tiers: int, gaps: np.ndarray | None = None,
                holdout: tuple[np.ndarray, np.ndarray] | None = None) -> LearnedModel | None:
    """The predictor fitted on all frees, with its held-out quality (on ``holdout``'s rows and labels
    when given) and the credit from the friendly frees' ``gaps`` (none given: strict buckets);
    None when the labels are all one class."""
    sizes = (n_cells, n_tiers) + (N_LOG_BINS,) * len(LOG_BINNED)
    if len(np.unique(labels)) < 2:
        return None
    quality = {"n_frees": int(len(labels)), "friendly_share": float(labels.mean())}
    model = _fit(rows, labels, sizes)
    if holdout is not None and len(holdout[1]):
        quality.update(_quality(model, labels, *holdout, sizes), holdout_window=1.0)
    else:
        split = int(len(labels) * (1 - HOLDOUT_SHARE))
        if len(np.unique(labels[:split])) == 2 and split < len(labels):
            quality.update(_quality(_fit(rows[:split], labels[:split], sizes), labels[:split], rows[split:],
                                    labels[split:], sizes), holdout_window=0.0)
    weights = np.split(model.coef_[0], np.cumsum(sizes)[:-1])
    friendly_gaps = gaps[labels == 1] if gaps is not None else np.zeros(0)
    credit = float(np.quantile(friendly_gaps, CREDIT_QUANTILE)) if len(friendly_gaps) else LearnedModel.credit_s
    return LearnedModel(float(model.intercept_[0]), **{name: tuple(float(w) for w in part)
                                                       for name, part in zip(FEATURES, weights)}, edges=EDGES, credit_s=min(max(credit, 0.0), 1e9), quality=quality)


def _quality(model, trained_on: np.ndarray, rows: np.ndarray, labels: np.ndarray, sizes) -> dict:
    """Log-loss and accuracy of ``model`` on held-out frees, beside the base rate's log-loss."""
    from sklearn.metrics import log_loss

    predicted = model.predict_proba(_one_hot(rows, sizes))[:, 1]
    return {"holdout_n_frees": int(len(labels)), "holdout_base_rate": float(labels.mean()),
            "holdout_log_loss": float(log_loss(labels, predicted, labels=[0, 1])),
            "holdout_base_log_loss": float(log_loss(labels, np.full(len(labels), trained_on.mean()), labels=[0, 1])),
            "holdout_accuracy": float(np.mean((predicted >= 0.5) == (labels == 1)))}
