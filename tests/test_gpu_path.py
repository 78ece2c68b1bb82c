"""How CUDA tensors travel, tested without a GPU: the choice between NCCL and the host path
(``cuda_path``: NCCL only when every rank has a GPU of its own and none asks for MPI with
``HOROVOD_GPU_OPERATIONS``), that variable as Horovod spells it, and the host path itself
on CPU tensors over real MPI (tests/mpi/host_path.py). The CUDA copies themselves are
checked on a GPU by tests/test_cuda.py."""
import pytest
import torch

from hvd_magic import config
from hvd_magic.collectives.backends.torch_dist import cuda_path, gpu_identity
from mpi_harness import mpirun

GPU0 = ("node1", "GPU-0b42632a")
GPU1 = ("node1", "GPU-77f1c2d0")


def test_two_ranks_sharing_one_gpu_take_the_host_path():
    """(NCCL refuses two ranks on one device: a 2-rank pool on a 1-GPU machine.)"""
    assert cuda_path([("nccl", GPU0), ("nccl", GPU0)]) == "host"
    assert cuda_path([("nccl", GPU0), ("nccl", GPU1), ("nccl", GPU0)]) == "host"


def test_ranks_on_gpus_of_their_own_take_nccl():
    assert cuda_path([("nccl", GPU0)]) == "nccl"
    assert cuda_path([("nccl", GPU0), ("nccl", GPU1)]) == "nccl"
    # the same device index on two hosts is two GPUs
    assert cuda_path([("nccl", ("node1", "cuda:0")), ("nccl", ("node2", "cuda:0"))]) == "nccl"


def test_horovod_gpu_operations_mpi_on_any_rank_takes_the_host_path():
    assert cuda_path([("mpi", GPU0)]) == "host"
    assert cuda_path([("nccl", GPU0), ("mpi", GPU1)]) == "host"


def test_a_rank_that_cannot_run_nccl_sends_every_rank_through_host_memory():
    assert cuda_path([("nccl", GPU0), ("nccl", None)]) == "host"


def test_horovod_gpu_operations_takes_horovods_values():
    assert config.get("HOROVOD_GPU_OPERATIONS", {}) == "nccl"
    assert config.get("HOROVOD_GPU_OPERATIONS", {"HOROVOD_GPU_OPERATIONS": "MPI"}) == "mpi"
    assert config.get("HOROVOD_GPU_OPERATIONS", {"HOROVOD_GPU_OPERATIONS": "NCCL"}) == "nccl"
    with pytest.raises(ValueError, match="HOROVOD_GPU_OPERATIONS='GLOO': use one of nccl, mpi"):
        config.get("HOROVOD_GPU_OPERATIONS", {"HOROVOD_GPU_OPERATIONS": "GLOO"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_a_rank_counts_as_one_without_nccl():
    assert gpu_identity() is None


@pytest.mark.parametrize("np_", [2, 3])
def test_host_path_collectives_over_mpi(np_):
    """allreduce (in and out of place, fused, half types), allgather, broadcast, alltoall and
    reducescatter through the host path's copies and the MPI backend."""
    proc = mpirun("host_path.py", np_, timeout=120)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout
