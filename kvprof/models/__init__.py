"""Reuse-probability models and the hyperparameter file schema."""
