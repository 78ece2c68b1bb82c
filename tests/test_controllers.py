"""One test, two controllers: the runtime's multi-rank checks (tests/mpi/) under torchrun,
where hvd.init() finds no MPI world and coordinates over torch.distributed (gloo), at 2 and
3 ranks. The same scripts run under mpiexec in test_collectives.py, test_torch.py,
test_adasum.py and test_process_sets.py; here a representative subset runs under torchrun
(every op/dtype/shape, mismatch errors, the stall check, the response cache, the PyTorch
DistributedOptimizer equivalence, Adasum, process sets), which keeps the suite's added time
to a few minutes on 2 cores."""
from __future__ import annotations

import re

import pytest

from mpi_harness import launch, probes, torchrun

NP = pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])


@pytest.mark.parametrize("launcher, np_", [("mpiexec", 2), ("torchrun", 3)],
                         ids=["mpiexec-np2", "torchrun-np3"])
def test_each_launcher_gives_one_world_of_n_ranks(launcher, np_):
    """Under torchrun each process used to see rank 0 of size 1 and train alone, silently.
    Now every launcher gives ranks 0..N-1 of one world of N, with the launcher's local ranks,
    and under torchrun MPI is never initialized and hvd.elastic.run says in one line that
    it needs MPI."""
    proc = launch(launcher, "controller_probe.py", np_, env={"PROBE_ELASTIC": "1"}, timeout=180)
    got = probes(proc.stdout)
    assert sorted(got) == list(range(np_)), proc.stdout + proc.stderr
    for r, f in got.items():
        assert f["size"] == str(np_) and f["sum"] == f"{np_ * (np_ + 1) // 2}", f
        assert f["local"] == f"{r}/{np_}" and f["cross"] == "0/1", f
        if launcher == "torchrun":
            assert f["controller"] == "gloo" and f["mpi_initialized"] == "False", f
        else:
            assert f["controller"] == "mpi", f
    if launcher == "torchrun":
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("elastic:"))
        assert line.startswith("elastic: HvdError: elastic training needs the MPI controller"), line
        assert "hvdrun --min-np" in line, line


def test_controller_env_forces_mpi_under_torchrun():
    """HOROVOD_CONTROLLER=mpi (Horovod's variable) keeps MPI even under torchrun: with no
    MPI launcher, each process is then a singleton MPI world of one rank."""
    proc = torchrun("controller_probe.py", 2, env={"HOROVOD_CONTROLLER": "mpi"}, timeout=180)
    got = probes(proc.stdout)
    assert [f["size"] for f in got.values()] == ["1"], proc.stdout   # both print rank 0
    assert proc.stdout.count("probe rank=0 size=1") == 2 and "controller=mpi" in proc.stdout


def test_every_op_dtype_shape_under_torchrun():
    """coll_ops' checks (every op, dtype, shape, numpy and torch, in place, async, grouped,
    object ops) with negotiation and data over gloo (2 ranks; the odd ring of 3 runs the
    error, cache, Adasum, process set and optimizer checks)."""
    proc = torchrun("coll_ops.py", 2, "gloo", timeout=400)
    assert proc.stdout.count("coll_ops OK") == 2, proc.stdout


@NP
def test_mismatch_errors_on_every_rank_under_torchrun(np_):
    proc = torchrun("coll_errors.py", np_, timeout=180)
    assert proc.stdout.count("coll_errors OK") == np_, proc.stdout


@NP
def test_torch_optimizer_equivalence_under_torchrun(np_):
    """DistributedOptimizer's weights equal one process trained on the whole batch, the
    broadcasts, SyncBatchNorm and autograd checks of torch_checks.py."""
    proc = torchrun("torch_checks.py", np_, timeout=400)
    for r in range(np_):
        assert f"[rank {r}] done, 0 failures" in proc.stdout, proc.stdout


def test_stall_warning_and_shutdown_under_torchrun():
    proc = torchrun("coll_stall.py", 2, timeout=180)
    assert proc.stdout.count("coll_stall OK") == 2, proc.stdout
    assert re.search(r"\[hvd_magic rank 0\] WARNING: stall.*\n\s+allreduce of tensor 'slow' has "
                     r"waited [\d.]+ s: submitted by rank\(s\) 0, not yet by rank\(s\) 1\n",
                     proc.stderr), proc.stderr


def test_response_cache_under_torchrun_at_3_ranks():
    proc = torchrun("coll_cache.py", 3, timeout=240)
    assert proc.stdout.count("done, 0 failures") == 3, proc.stdout + proc.stderr


def test_adasum_under_torchrun_at_3_ranks():
    """Adasum over gloo, with the fold of a rank count that is not a power of two."""
    proc = torchrun("coll_adasum.py", 3, timeout=300)
    assert proc.stdout.count("coll_adasum OK") == 3, proc.stdout


def test_process_sets_under_torchrun_at_3_ranks():
    proc = torchrun("process_sets.py", 3, timeout=300)
    assert proc.stdout.count("process_sets OK") == 3, proc.stdout


@pytest.mark.parametrize("env, want", [
    ({}, "mpi"),                                                        # a lone process
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "gloo"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),                             # mpiexec wins
    ({"PMIX_RANK": "0"}, "mpi"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "HOROVOD_CONTROLLER": "mpi"}, "mpi"),
    ({"HOROVOD_CONTROLLER": "gloo"}, "gloo"),
])
def test_the_controller_is_chosen_from_the_launcher_environment(monkeypatch, env, want):
    from hvd_magic.collectives import controller
    for var in controller.MPI_LAUNCHER_VARS + controller.TORCH_LAUNCHER_VARS + ("HOROVOD_CONTROLLER",):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert controller.choose() == want


def _hvdrun(*argv: str, timeout: float = 180):
    """hvdrun (MPI, or --gloo) from this venv; fail with both streams on error."""
    import sys
    from pathlib import Path

    from mpi_harness import mpi_env, run_job
    cmd = [str(Path(sys.executable).with_name("hvdrun")), *argv]
    proc = run_job(cmd, mpi_env(), timeout, " ".join(argv[:3]))
    assert proc.returncode == 0, f"hvdrun {' '.join(argv)}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _weights(stdout: str) -> list:
    return re.search(r"weights (\[.*\])", stdout).group(1)


def test_readme_example_trains_to_the_same_weights_under_every_launcher():
    """The README's example trained by `hvdrun -np 2` (MPI), `torchrun --nproc-per-node 2`
    and `hvdrun --gloo -np 2` ends with the same weights, bit for bit."""
    import sys

    from mpi_harness import HERE
    script = str(HERE / "mpi" / "readme_example.py")
    mpi = _weights(_hvdrun("-np", "2", sys.executable, script).stdout)
    tr = _weights(torchrun("readme_example.py", 2, timeout=180).stdout)
    gl = _weights(_hvdrun("--gloo", "-np", "2", sys.executable, script).stdout)
    assert mpi == tr == gl, (mpi, tr, gl)


def test_horovod_digits_script_same_weights_under_torchrun_and_hvdrun_gloo(tmp_path):
    """tests/mpi/torch_digits.py (a Horovod script, only the import changed): the
    checkpoint after `torchrun` and after `hvdrun --gloo` equals the one after
    `hvdrun -np 2` (MPI)."""
    import sys

    import torch

    from mpi_harness import HERE
    script = str(HERE / "mpi" / "torch_digits.py")
    runs = {name: tmp_path / name for name in ("mpi", "torchrun", "gloo")}
    for d in runs.values():
        d.mkdir()
    _hvdrun("-np", "2", sys.executable, script, str(runs["mpi"]))
    torchrun("torch_digits.py", 2, str(runs["torchrun"]), timeout=180)
    _hvdrun("--gloo", "-np", "2", sys.executable, script, str(runs["gloo"]))
    ref = torch.load(runs["mpi"] / "checkpoint.pt")["model"]
    for name in ("torchrun", "gloo"):
        got = torch.load(runs[name] / "checkpoint.pt")["model"]
        for k in ref:
            assert torch.allclose(ref[k], got[k], atol=1e-6, rtol=0), (name, k)


def test_hvdrun_gloo_names_a_dead_rank_and_stops_the_others():
    """A rank that exits with an error ends the job: hvdrun names it, stops the others
    (one of which waits in a collective) and exits with the rank's status."""
    import sys
    import time
    from pathlib import Path

    from mpi_harness import mpi_env, run_job
    cmd = [str(Path(sys.executable).with_name("hvdrun")), "--gloo", "-np", "3", sys.executable,
           "-c", "import os, time, torch, hvd_magic.torch as hvd\n"
                 "hvd.init()\n"
                 "if hvd.rank() == 1: os._exit(3)\n"
                 "hvd.allreduce(torch.ones(1), name='x')\n"
                 "time.sleep(120)\n"]
    t0 = time.monotonic()
    proc = run_job(cmd, mpi_env(), 150, "hvdrun --gloo")
    assert proc.returncode == 3, proc.stderr
    assert re.search(r"hvdrun: rank 1 \(pid \d+\) exited with status 3; stopping the other ranks",
                     proc.stderr), proc.stderr
    assert time.monotonic() - t0 < 100, "the others were not stopped"


def test_hvdrun_gloo_on_one_host_listens_on_loopback_only(tmp_path):
    """hvdrun --gloo on this host opens no port beyond 127.0.0.1: neither hvdrun's
    rendezvous store (torch's own store listens on every interface) nor the ranks' gloo."""
    import sys
    from pathlib import Path

    from mpi_harness import mpi_env, run_job
    script = tmp_path / "listeners.py"
    script.write_text(
        "import os, psutil, torch\n"
        "import hvd_magic.torch as hvd\n"
        "hvd.init()\n"
        "hvd.allreduce(torch.ones(1), name='x')\n"
        "addrs = {c.laddr.ip for pid in (os.getpid(), os.getppid())\n"
        "         for c in psutil.Process(pid).net_connections(kind='inet')\n"
        "         if c.status == psutil.CONN_LISTEN}\n"
        "print(f'rank {hvd.rank()} listens on {sorted(addrs)}', flush=True)\n"
        "hvd.barrier()\n")
    hvdrun = str(Path(sys.executable).with_name("hvdrun"))
    proc = run_job([hvdrun, "--gloo", "-np", "2", sys.executable, str(script)], mpi_env(), 180, "")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(r"^rank \d listens on \[([^\]]*)\]$", proc.stdout, re.M)
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        assert line and set(line.replace("'", "").split(", ")) == {"127.0.0.1"}, proc.stdout


def test_hvdrun_gloo_keeps_each_rank_line_whole():
    """Two ranks printing at once under PYTHONUNBUFFERED (print writes its text and its
    newline separately): every line hvdrun --gloo shows is one rank's whole line, on stdout
    and on stderr, and none is lost."""
    import sys
    from pathlib import Path

    from mpi_harness import mpi_env, run_job
    hvdrun = str(Path(sys.executable).with_name("hvdrun"))
    script = ("import os, sys\n"
              "r = os.environ['RANK']\n"
              "for i in range(3000):\n"
              "    print(f'rank {r} line {i}', 'x' * 40)\n"
              "    print(f'rank {r} err {i}', file=sys.stderr)\n")
    proc = run_job([hvdrun, "--gloo", "-np", "2", sys.executable, "-c", script],
                   {**mpi_env(), "PYTHONUNBUFFERED": "1"}, 120, "")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out, err = proc.stdout.splitlines(), proc.stderr.splitlines()
    bad = [ln for ln in out if not re.fullmatch(r"rank [01] line \d+ x{40}", ln)]
    bad += [ln for ln in err if not re.fullmatch(r"rank [01] err \d+", ln)]
    assert not bad, bad[:5]
    assert len(out) == len(err) == 6000


def test_hvdrun_gloo_refuses_what_needs_mpi():
    import sys
    from pathlib import Path

    from mpi_harness import mpi_env, run_job
    hvdrun = str(Path(sys.executable).with_name("hvdrun"))
    proc = run_job([hvdrun, "--gloo", "-np", "2", "--min-np", "1", "true"], mpi_env(), 60, "")
    assert proc.returncode == 2 and "needs MPI: leave out --gloo" in proc.stderr, proc.stderr


def test_a_process_group_the_user_initialized_selects_the_gloo_controller():
    """No launcher's variables: the processes called init_process_group themselves, then
    hvd.init() runs on that group; local and cross ranks come from the host names."""
    import socket
    import subprocess
    import sys

    from mpi_harness import HERE, torch_env
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in torch_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    script = str(HERE / "mpi" / "user_process_group.py")
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "".join(o for o, _ in outs)
    assert all(p.returncode == 0 for p in procs), outs
    for r in (0, 1):
        assert f"pg rank={r} size=2 local={r}/2 cross=0/1 sum=3" in out, outs
