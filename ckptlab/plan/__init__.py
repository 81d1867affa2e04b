"""What to recompute: the per-block profile, the peak model and its solver, `plan_budget`, and the
one place a `budget=` becomes a plan."""
