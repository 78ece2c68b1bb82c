"""HOROVOD_AUTOTUNE=1 on real ranks: a loop of many small allreduces (as a training step
without gradient buckets) runs while rank 0 tries settings. Checks that every step's results
stay right while the fusion threshold and cycle time change under it, that every rank ends on
the same settled setting, and that rank 0's log has Horovod's columns, one row per trial and
the chosen setting (the best mean score) last.

usage: autotune.py LOGFILE   (env: HOROVOD_AUTOTUNE=1, small warm-up and sample sizes)"""
import csv
import sys
import time

import numpy as np

import hvd_magic.collectives as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
fails = []
shapes = [(64,), (300,), (17, 5), (1000,), (8,), (256, 4)] * 4      # 24 small tensors a step
step = 0
deadline = time.monotonic() + 90

def tuning():
    """Whether any rank still tunes (ranks apply a setting in the same cycle, but one may
    look between steps before and another after it): the loop ends on every rank at once."""
    active = np.array([float(hvd.autotune_status()["active"])])
    return hvd.allreduce(active, name="tuning", op=hvd.Max)[0] > 0


while tuning() and time.monotonic() < deadline:
    handles = [hvd.allreduce_async(np.full(s, rank + i + step, np.float32), name=f"g{i}",
                                   op=hvd.Sum) for i, s in enumerate(shapes)]
    for i, (h, s) in enumerate(zip(handles, shapes)):
        got = hvd.synchronize(h)
        want = sum(r + i + step for r in range(size))
        if got.shape != s or not np.all(got == want):
            fails.append(f"step {step} g{i}: {got.ravel()[:3]} != {want}")
    step += 1
status = hvd.autotune_status()
everyone = hvd.allgather_object(status)
if status["active"]:
    fails.append(f"still tuning after {step} steps: {status}")
if any(s != everyone[0] for s in everyone):
    fails.append(f"ranks settled differently: {everyone}")
# what the settled threshold does: the 24 tensors of a step go as fused buffers or alone
if rank == 0:
    rows = list(csv.reader(open(sys.argv[1])))
    header, trials, best = rows[0], rows[1:-1], rows[-1]
    if header != ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
                  "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score"]:
        fails.append(f"header {header}")
    if len(trials) < 3:
        fails.append(f"only {len(trials)} trials logged")
    by_setting = {}
    for r in trials:                     # a setting's score: the mean of its trials
        by_setting.setdefault((r[4], r[5]), []).append(float(r[-1]))
    top = max(by_setting, key=lambda k: sum(by_setting[k]) / len(by_setting[k]))
    if (best[4], best[5]) != top:
        fails.append(f"last row {best} is not the best setting {top}: {by_setting}")
    if [float(best[5]), float(best[4])] != [status["fusion_mb"], status["cycle_ms"]]:
        fails.append(f"settled on {status}, log says {best}")
    print(f"autotune: {len(trials)} trials in {step} steps, settled on {status}")
hvd.shutdown()
for f in fails:
    print(f"rank {rank}: FAIL {f}")
print("autotune OK" if not fails else "autotune FAILED")
sys.exit(1 if fails else 0)
