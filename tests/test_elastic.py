"""hvd.elastic.run surviving a lost rank, for real: Horovod's names, a script under
`hvdrun --min-np`, one rank SIGKILLed mid-epoch (tests/mpi/elastic_torch.py)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_harness import mpi_env

HERE = Path(__file__).parent
HVDRUN = str(Path(sys.executable).with_name("hvdrun"))


def hvdrun(np_, min_np, *args, timeout=120):
    cmd = [HVDRUN, "-np", str(np_), *(["--min-np", str(min_np)] if min_np else []),
           sys.executable, str(HERE / "mpi" / "elastic_torch.py"), *args]
    try:
        return subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hung: {exc.stdout}\n{exc.stderr}") from None


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_a_killed_rank_costs_one_rank_and_the_uncommitted_steps(np_):
    proc = hvdrun(np_, np_ - 1)
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic OK") == np_ - 1, out
    assert f"elastic: lost rank(s) {np_ - 1}; continuing on {np_ - 1} rank(s) from commit" in out
    kill = float(re.search(r"KILL (\S+)", out).group(1))
    resumed = float(re.search(r"RESUMED (\S+)", out).group(1))
    assert resumed - kill <= 10.0, out


def test_two_losses_in_a_row_one_of_them_rank_0():
    # rank 2 dies in epoch 0; in epoch 1, rank 0 (the root every sync broadcasts from) dies
    proc = hvdrun(3, 1, "0:5:2,1:3:0")
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic OK") == 1, out
    assert "lost rank(s) 2; continuing on 2 rank(s)" in out
    assert "lost rank(s) 0; continuing on 1 rank(s)" in out


def test_a_loss_before_the_first_commit_goes_back_to_the_start():
    proc = hvdrun(3, 2, "0:1:2")
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic OK") == 2, out
    assert "lost rank(s) 2; continuing on 2 rank(s) from commit 0" in out


def test_fewer_survivors_than_min_np_is_an_error_that_says_so():
    proc = hvdrun(2, 2)
    out = proc.stdout + proc.stderr
    assert "elastic OK" not in out and proc.returncode != 0, out
    assert "rank(s) 1 were lost and 1 rank(s) are left, fewer than the minimum of 2" in out


def test_elastic_without_fault_tolerance_says_how_to_start_it():
    proc = hvdrun(2, None)
    assert proc.returncode != 0
    assert "elastic training needs MPI fault tolerance (ULFM)" in proc.stderr
    assert "hvdrun --min-np N" in proc.stderr


def test_keras_fit_with_the_elastic_callbacks_survives_a_killed_rank():
    cmd = [HVDRUN, "-np", "3", "--min-np", "2", sys.executable,
           str(HERE / "mpi" / "elastic_keras.py")]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic keras OK") == 2, out
    assert "elastic: lost rank(s) 2; continuing on 2 rank(s) from commit" in out
    kill = float(re.search(r"KILL (\S+)", out).group(1))
    assert float(re.search(r"RESUMED (\S+)", out).group(1)) - kill <= 10.0, out
