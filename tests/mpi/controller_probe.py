"""Which controller hvd.init() chose and the world it sees, one line per rank:
``probe rank=R size=N local=L/LS cross=C/CS controller=... mpi_initialized=...``; then
an allreduce that only the whole world gets right, and what ``hvd.elastic.run`` says."""
import os
import sys

import torch

import hvd_magic.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="probe")
mpi = sys.modules.get("mpi4py.MPI")
# (one write per line: a pipe keeps writes under 4 KiB whole, print's two writes are not)
sys.stdout.write(f"probe rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
                 f"cross={hvd.cross_rank()}/{hvd.cross_size()} "
                 f"controller={'gloo' if hvd.gloo_enabled() else 'mpi' if hvd.mpi_enabled() else '?'} "
                 f"mpi_initialized={bool(mpi is not None and mpi.Is_initialized())} "
                 f"sum={total.item():g}\n")
sys.stdout.flush()
if os.environ.get("PROBE_ELASTIC") == "1" and hvd.rank() == 0:
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)

    @hvd.elastic.run
    def train(state):
        return state.step

    try:
        train(state)
        print("elastic: ran", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"elastic: {type(e).__name__}: {e}", flush=True)
hvd.shutdown()
