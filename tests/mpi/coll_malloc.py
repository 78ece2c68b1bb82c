"""Page faults of repeated grouped allreduces after hvd.init(): prints one line per rank,
``FAULTS <rank> <minor faults per call>``."""
import resource

import numpy as np

import hvd_magic.collectives as hvd

hvd.init()
ts = [np.zeros(1024, np.float32) for _ in range(100)]
for _ in range(20):
    hvd.grouped_allreduce(ts, op=hvd.Sum)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    hvd.grouped_allreduce(ts, op=hvd.Sum)
per_call = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 200
print(f"FAULTS {hvd.rank()} {per_call:.1f}", flush=True)
hvd.shutdown()
