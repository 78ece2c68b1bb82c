"""Integer reductions wrap as numpy's do, whatever the MPI library's own reduction code does
(Open MPI 5's ``op/avx`` saturates 8- and 16-bit sums of 16 elements and more: uint8
229 + 229 gave 255, not 202). Real mpiexec at 2 and 3 ranks (tests/mpi/coll_int8.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpi_harness import HERE, MPIEXEC, mpi_env, mpirun, run_job

NP = pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
LISTED = "reduced through numpy (MPI's own got them wrong): "


@NP
def test_integer_reductions_wrap_like_numpy(np_):
    """Sum/Min/Max/Product of every integer dtype at sizes across 15/16/31/32/64, odd sizes,
    fused buffers, shared-memory sizes and 1 Mi elements; numpy and torch faces, in place and
    out of place, global set and a process set, reducescatter; MPI (default, one call per
    tensor) and torch.distributed/gloo paths."""
    proc = mpirun("coll_int8.py", np_, timeout=900)
    assert proc.stdout.count("coll_int8 OK") == np_, proc.stdout + proc.stderr


def test_every_rank_reduces_the_same_way_when_only_one_ranks_mpi_is_wrong():
    """Rank 0 runs without Open MPI's vectorized reductions (right), rank 1 with them (wrong
    where they saturate): both must send the same pairs through numpy, and get right sums."""
    script = str(HERE / "mpi" / "coll_int8.py")
    cmd = [MPIEXEC, "-n", "1", "env", "OMPI_MCA_op=^avx", sys.executable, script, "mpi", ":",
           "-n", "1", sys.executable, script, "mpi"]
    proc = run_job(cmd, mpi_env(), 600, "coll_int8.py at 2 ranks, op/avx on rank 1 only")
    assert proc.returncode == 0 and proc.stdout.count("coll_int8 OK") == 2, \
        proc.stdout + proc.stderr


def test_mpis_own_reductions_are_kept_where_they_are_right():
    """Without the vectorized component, Open MPI's reductions are right: nothing goes
    through numpy (MPI's own op, the fast path, stays)."""
    proc = mpirun("coll_int8.py", 2, "mpi", env={"OMPI_MCA_op": "^avx"}, timeout=600)
    assert proc.stdout.count("coll_int8 OK") == 2, proc.stdout + proc.stderr
    assert LISTED + "[]" in proc.stdout, proc.stdout


SUM8 = ("import numpy as np, hvd_magic.collectives as hvd\n"
        "hvd.init()\n"
        "u = hvd.allreduce(np.full(64, 229, np.uint8), op=hvd.Sum)\n"
        "i = hvd.allreduce(np.full(64, 100, np.int8), op=hvd.Sum)\n"
        "print('sums', int(u.min()), int(u.max()), int(i.min()), int(i.max()))\n")


def test_hvdrun_and_the_pool_sum_8_bit_integers_as_numpy():
    """The launchers users meet: hvdrun's ranks and a %%hvd pool's get 229 + 229 = 202 and
    100 + 100 = -56 (wrapping), as numpy does."""
    hvdrun = str(Path(sys.executable).with_name("hvdrun"))
    proc = run_job([hvdrun, "-np", "2", sys.executable, "-c", SUM8], mpi_env(), 120,
                   "hvdrun 8-bit sums")
    assert proc.returncode == 0 and proc.stdout.count("sums 202 202 -56 -56") == 2, \
        proc.stdout + proc.stderr
    from hvd_magic.kernel import PoolManager, TextSink
    manager = PoolManager()
    try:
        pool = manager.ensure(2, None, None, TextSink())
        out = pool.run_cell(SUM8.replace("print(", "(").replace("'sums', ", ""), TextSink())
        assert [out.results[r]["text/plain"] for r in (0, 1)] == ["(202, 202, -56, -56)"] * 2
    finally:
        manager.stop()
