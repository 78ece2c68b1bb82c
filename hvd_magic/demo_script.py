"""``python -m hvd_magic.demo_script``: a 2-rank example through the hvdrun launcher (no notebook).

Each rank allreduces its rank, allgathers its name, and the two ranks fit a tiny linear
model together by averaging gradients with allreduce (numpy only, a second or two).
"""
from __future__ import annotations

import socket
import sys
import time
from typing import Any, Dict


def _rank_work(steps: int = 50) -> Dict[str, Any]:
    """What every rank runs (after hvd.init())."""
    import os

    import numpy as np

    import hvd_magic.collectives as hvd

    rank, size = hvd.rank(), hvd.size()
    total = float(hvd.allreduce(np.array([rank], dtype=np.float64), op=hvd.Sum)[0])
    names = hvd.allgather_object(f"rank{rank}@{socket.gethostname()}:pid{os.getpid()}")
    # Data-parallel least squares: each rank holds its own shard of y = 3x - 1 (+ noise).
    rng = np.random.default_rng(rank)
    x = rng.uniform(-1, 1, 256)
    y = 3.0 * x - 1.0 + rng.normal(0, 0.05, x.shape)
    w = hvd.broadcast(np.zeros(2), root_rank=0)
    for _ in range(steps):
        err = w[0] * x + w[1] - y
        grad = np.array([np.mean(err * x), np.mean(err)]) * 2.0
        w = w - 0.5 * hvd.allreduce(grad, op=hvd.Average)
    loss = float(hvd.allreduce(np.array([np.mean((w[0] * x + w[1] - y) ** 2)]), op=hvd.Average)[0])
    return {"rank": rank, "size": size, "sum_of_ranks": total, "names": names,
            "w": [float(v) for v in w], "loss": loss}


def main() -> int:
    """Run the example on 2 ranks and print what happened."""
    from hvd_magic import run

    t0 = time.perf_counter()
    results = run(_rank_work, np=2, timeout=120)
    took = time.perf_counter() - t0
    r0 = results[0]
    print(f"hvd_magic demo: started {r0['size']} ranks with hvdrun's launcher in {took:.1f} s")
    print(f"  allreduce(rank, Sum) on every rank -> {[r['sum_of_ranks'] for r in results]}")
    print(f"  allgather_object(name)             -> {r0['names']}")
    print(f"  fit y = 3x - 1 on 2 data shards with averaged gradients: "
          f"w = {r0['w'][0]:.3f}, b = {r0['w'][1]:.3f}, loss {r0['loss']:.4f}")
    same = all(r["w"] == r0["w"] for r in results)
    print(f"  both ranks hold the same weights: {same}")
    print("  the same from a shell: hvdrun -np 2 python train.py")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
