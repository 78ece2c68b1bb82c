"""TensorFlow jobs that grow at a commit, for real: `hvdrun -np 1 --min-np 1 --max-np 2` with
a host discovery script that adds a slot (tests/mpi/elastic_grow_tf.py). The training step
was traced while the job had one rank and runs on after the growth."""
import sys
from pathlib import Path

import pytest

from mpi_harness import mpi_env, run_job

pytest.importorskip("tensorflow")

HERE = Path(__file__).parent
HVDRUN = str(Path(sys.executable).with_name("hvdrun"))


@pytest.mark.parametrize("mode", ["tape", "keras"])
def test_a_tensorflow_job_grows_from_one_rank_to_two(tmp_path, mode):
    slots = tmp_path / "slots"
    slots.write_text("localhost:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {slots}\n")
    script.chmod(0o755)
    cmd = [HVDRUN, "-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
           str(script), sys.executable, str(HERE / "mpi" / "elastic_grow_tf.py"), str(slots), mode]
    proc = run_job(cmd, mpi_env(), 180, f"hvdrun (TensorFlow, {mode})")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.count("elastic tf OK") == 2 and "JOINED as rank 1" in out, out
    assert "hosts updated, 1 rank(s) joined; continuing on 2 rank(s) from commit 1" in out, out
