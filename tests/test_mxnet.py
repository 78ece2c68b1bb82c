"""hvd_magic.mxnet: the pure parts here (the main environment has no MXNet), the face itself
under mpiexec at 2 and 3 ranks in .venv-mxnet (MXNet 1.9.1 needs numpy<1.24: its own
environment, made by `make setup`). Skipped, saying why, when .venv-mxnet is missing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_harness import HERE, mpi_env

from hvd_magic.mxnet import plan

ROOT = HERE.parent
NOTEBOOK = ROOT / "notebooks" / "mxnet" / "mxnet_gluon.ipynb"
MX_PY = ROOT / ".venv-mxnet" / "bin" / "python"
NP = pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
needs_mx_venv = pytest.mark.skipif(
    not MX_PY.exists(), reason=".venv-mxnet is missing: `make setup` creates it (MXNet 1.9.1 "
    "needs numpy<1.24, so it cannot live in .venv)")

# horovod.mxnet 0.28's public names (its __init__.py)
HOROVOD_MXNET_NAMES = """
Compression allgather_object broadcast_object allgather grouped_allgather allreduce allreduce_
grouped_allreduce grouped_allreduce_ alltoall broadcast broadcast_ reducescatter
grouped_reducescatter init shutdown is_initialized start_timeline stop_timeline size local_size
cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled
gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product DistributedOptimizer
DistributedTrainer broadcast_parameters
""".split()


def mx_mpirun(script: str, np_: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """tests/mpi/<script> on np_ ranks with .venv-mxnet's python and mpiexec."""
    cmd = [str(MX_PY.with_name("mpiexec")), "-n", str(np_), str(MX_PY), str(HERE / "mpi" / script)]
    try:
        proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} at {np_} ranks did not finish within {timeout} s\n"
                             f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}") from None
    assert proc.returncode == 0, f"{script} at {np_} ranks exited {proc.returncode}\n" \
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_every_horovod_mxnet_name_is_there_without_importing_mxnet():
    import hvd_magic.mxnet as hvd       # (the main environment has no mxnet)
    missing = [n for n in HOROVOD_MXNET_NAMES if n not in hvd.__all__]
    assert not missing


def test_split_list_cuts_into_near_equal_runs_longest_first():
    assert plan.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert plan.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan.split_list([1], 3) == [[1]]          # no empty groups
    with pytest.raises(ValueError, match="num_groups"):
        plan.split_list([1], 0)


def test_group_by_dtype_keeps_first_seen_order():
    class T:
        def __init__(self, dtype):
            self.dtype = dtype
    a, b, c = T("float32"), T("float16"), T("float32")
    runs = plan.group_by_dtype([(a, "a"), (b, "b"), (c, "c")])
    assert [[n for _, n in run] for run in runs] == [["a", "c"], ["b"]]


def test_gradient_predivide_factor_checks():
    assert plan.check_predivide(2) == 2.0
    with pytest.raises(ValueError, match="must not be 0"):
        plan.check_predivide(0)
    with pytest.raises(TypeError, match="number"):
        plan.check_predivide("x")


def test_dtype_check_names_horovods_dtypes():
    from hvd_magic.mxnet.tensors import check_dtype
    check_dtype("float16", "allreduce")
    with pytest.raises(TypeError, match="bool is not supported.*uint8, int8, int32, int64"):
        check_dtype("bool", "allreduce")


@needs_mx_venv
@NP
def test_mxnet_face_under_mpi(np_):
    """Every collective and dtype, process sets, objects, compression, broadcast_parameters
    (deferred init), DistributedTrainer / DistributedOptimizer == one process on the whole
    batch, mismatch errors naming tensor and ranks on every rank."""
    proc = mx_mpirun("mxnet_checks.py", np_, timeout=120)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout


@needs_mx_venv
def test_mxnet_notebook_on_a_mxnet_kernel(tmp_path):
    """notebooks/mxnet/ (left out of the main run by pyproject's addopts: .venv has no
    mxnet) runs top to bottom under nbval with "python3" meaning .venv-mxnet's Python, so
    that its %%hvd pool runs there too; cells marked NBVAL_CHECK_OUTPUT are compared."""
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(MX_PY), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (.venv-mxnet)", "language": "python"}))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--nbval-lax", "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"),
           str(NOTEBOOK)]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env({"JUPYTER_PATH": str(tmp_path)}),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
