"""Per-job overhead of `executor="submitit"` with submitit's LocalExecutor on this machine.

    python benchmarks/job_overhead.py [--repeats N]

Times submit -> result for jobs that do no measuring, one at a time: `time.sleep(0)` (submitit's
own cost: a controller process, a job process, pickles on disk) and an empty `ckptlab.run.cluster.run_job`
(that plus importing torch and ckptlab in the job, which every real job pays).
"""

import argparse
import statistics
import tempfile
import time

import submitit

from ckptlab.run.cluster import run_job
from ckptlab.run.config import SweepConfig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="jobs per kind (1: the smallest setting)")
    repeats = parser.parse_args(argv).repeats
    with tempfile.TemporaryDirectory() as tmp:
        grid = SweepConfig(policies=["none"], out=f"{tmp}/run").to_dict()
        ex = submitit.AutoExecutor(folder=f"{tmp}/%j", cluster="local")
        ex.update_parameters(timeout_min=5)
        for label, fn, args in [("submitit only (time.sleep(0))", time.sleep, (0,)),
                                ("+ import torch/ckptlab (empty run_job)", run_job, (grid, [], f"{tmp}/p.jsonl"))]:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ex.submit(fn, *args).result()
                times.append(time.perf_counter() - t0)
            print(f"{label}: median {statistics.median(times):.1f} s over {repeats} jobs "
                  f"(min {min(times):.1f}, max {max(times):.1f})")


if __name__ == "__main__":
    main()
