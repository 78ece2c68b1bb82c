"""A job whose processes set up torch.distributed themselves (no launcher's variables), then
call hvd.init(): usage ``python user_process_group.py RANK PORT`` for ranks 0 and 1.
Prints ``pg rank=R size=N local=L/LS cross=C/CS sum=S``."""
import sys

import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

import hvd_magic.torch as hvd  # noqa: E402

hvd.init()
x = hvd.allreduce(torch.ones(2) * (rank + 1), op=hvd.Sum, name="x")
sys.stdout.write(f"pg rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/"
                 f"{hvd.local_size()} cross={hvd.cross_rank()}/{hvd.cross_size()} "
                 f"sum={x[0].item():g}\n")
sys.stdout.flush()
hvd.shutdown()
