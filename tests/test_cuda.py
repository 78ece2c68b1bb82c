"""hvd_magic.torch on CUDA tensors: every collective and DistributedOptimizer at 1 rank
(torch.distributed with NCCL) and at 2 ranks sharing one GPU (NCCL refuses two ranks on
one device, so their tensors go through host memory), and the timeline of a GPU step.

Marked ``gpu``: they skip where torch sees no CUDA GPU, as on this project's machines and
in CI. ``benchmarks/gpu_check.sh`` runs them on a machine with one (``pytest -m gpu``).
With ``HVD_GPU_CHECK_DEVICE=cpu`` the same checks run on CPU tensors (``gpu_check.sh
--cpu``): a dry run of the worker script where there is no GPU, which checks nothing
about CUDA. The workers are in tests/mpi/cuda_checks.py. The last test, run where there is
no GPU, checks that gpu_check.sh then says so in one line and exits 0."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import hvd_magic.torch as hvd
from mpi_harness import mpirun

DEVICE = os.environ.get("HVD_GPU_CHECK_DEVICE", "cuda")
ROOT = Path(__file__).resolve().parent.parent

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def gpu(test):
    """Mark ``test`` as a GPU test, skipped where torch sees no CUDA GPU (unless the dry run
    asks for CPU tensors)."""
    test = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason=NO_GPU)(test)
    return pytest.mark.gpu(test)


def checks(what, np_, env=None, timeout=90):
    """Run tests/mpi/cuda_checks.py ``what`` at ``np_`` ranks; its ``CHECK ... ok`` lines."""
    env = dict(env or {})
    if DEVICE == "cpu" and np_ == 1:
        env.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")   # the code NCCL runs, on CPU tensors
    proc = mpirun("cuda_checks.py", np_, what, "--device", DEVICE, env=env, timeout=timeout)
    return [line for line in proc.stdout.splitlines() if line.startswith("CHECK ")]


COLLECTIVE_CHECKS = 6 * 3      # allreduce, grouped, allgather, broadcast, alltoall, reducescatter x dtypes


@gpu
def test_every_collective_at_1_rank_through_nccl():
    """allreduce Sum/Average/Min/Max (out of place, in place, async, postscale), grouped
    allreduce, allgather, broadcast, alltoall, reducescatter in float32, float16 and
    bfloat16: right values, results on the input's device; torch.distributed's backend
    for them is NCCL."""
    ok = checks("collectives", 1)
    assert len(ok) == COLLECTIVE_CHECKS + (DEVICE == "cuda"), ok


@gpu
def test_distributed_optimizer_at_1_rank_through_nccl():
    """DistributedOptimizer (SGD with momentum) training a small CNN on the GPU ends at the
    weights of plain training on the same batches."""
    assert len(checks("optimizer", 1)) == 2


@gpu
def test_timeline_of_a_gpu_step(tmp_path):
    """HOROVOD_TIMELINE during GPU training steps: a valid Chrome trace (a JSON array of
    events) with the gradients' allreduce in it, named as in Horovod (NCCL_ALLREDUCE for
    CUDA tensors)."""
    path = tmp_path / "timeline.json"
    assert len(checks("timeline", 1, env={"HOROVOD_TIMELINE": str(path)})) == 1
    events = json.loads(path.read_text())
    assert isinstance(events, list) and events
    for ev in events:
        assert {"ph", "pid"} <= set(ev), ev
        assert ev["ph"] == "M" or isinstance(ev.get("ts"), (int, float)), ev
    names = {ev.get("name") for ev in events if ev["ph"] != "M"}
    reduce_names = {n for n in names if n and n.endswith("_ALLREDUCE") and not n.startswith("NEGOTIATE_")}
    assert reduce_names, names
    if DEVICE == "cuda":
        assert reduce_names == {"NCCL_ALLREDUCE"}, names


@gpu
def test_cuda_allreduce_single_rank(one_rank):
    """In this process, without mpiexec: a CUDA tensor's allreduce stays on its device."""
    if DEVICE == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    t = torch.ones(3, device=DEVICE)
    out = hvd.allreduce(t, op=hvd.Sum)
    assert out.device == t.device
    assert torch.equal(out.cpu(), torch.ones(3) * hvd.size())


# At 2 ranks last, with shorter limits: where they hang, the checks above have run and
# gpu_check.sh still ends within its limits.
@gpu
def test_every_collective_at_2_ranks_sharing_the_gpu():
    """Every collective as at 1 rank, at 2 ranks on one GPU, where NCCL cannot run (it
    refuses two ranks on one device): the tensors go through host memory."""
    assert len(checks("collectives", 2, timeout=75)) == COLLECTIVE_CHECKS


@gpu
def test_distributed_optimizer_at_2_ranks_sharing_the_gpu():
    """DistributedOptimizer at 2 ranks on one GPU, each on its half of every batch, ends at
    the weights of one process trained on the whole batches."""
    assert len(checks("optimizer", 2, timeout=75)) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0():
    """(A machine without a GPU, a CI runner say, is no failure of the check.)"""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc
    assert proc.stdout.startswith("gpu_check: no CUDA GPU here") and proc.stdout.count("\n") == 1, proc
