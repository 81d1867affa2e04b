"""Probes of one training step: memory (tracked, predicted), time, gradients, plans, sharded runs."""
