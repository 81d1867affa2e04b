"""Applying and removing checkpoint policies on a model's repeated blocks."""
