"""Workloads: the models ckptlab measures (built-in, any Hugging Face architecture, your own from a
`file.py:factory` spec or `Workload.custom`) and `get_workload`, the one way to name them."""
