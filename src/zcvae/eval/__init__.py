"""Evaluation of a model on a validation set and its metrics."""
