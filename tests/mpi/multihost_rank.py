"""One rank of the multi-host hvdrun test: allreduce, then report where it ran as JSON."""
import json
import os
import socket

import numpy as np

import hvd_magic.collectives as hvd

hvd.init()
total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum)
gathered = hvd.allgather_object(socket.gethostname())
print("RANK " + json.dumps({
    "host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "sum": float(total[0]), "hosts": gathered, "path": os.environ.get("PATH", ""),
}), flush=True)
hvd.shutdown()
