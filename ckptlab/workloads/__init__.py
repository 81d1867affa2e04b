"""Workloads: the models ckptlab measures (built-in, Hugging Face) and `get_workload`."""
