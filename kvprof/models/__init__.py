"""Reuse-probability models and the hyperparameter file schema."""

from kvprof.models.exponential import CureExponential, diagnose, fit_classes, naive_fit
from kvprof.models.hp import ClassParams, HpFile, load_hp
from kvprof.models.score import published_score, reuse_probability
from kvprof.models.sessions import session_stats, turn_continuation_prior

__all__ = [
    "ClassParams",
    "CureExponential",
    "HpFile",
    "diagnose",
    "fit_classes",
    "load_hp",
    "naive_fit",
    "published_score",
    "reuse_probability",
    "session_stats",
    "turn_continuation_prior",
]
