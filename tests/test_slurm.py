"""Slurm for real: a two-node Slurm (slurmctld, two slurmd, munged) that the test starts on
this machine, each node in its own network namespace (slurm_cluster.py). The notebook's
kernel side, salloc, squeue and hvdrun run on node 1. Skipped only where Slurm's packages
are missing (``make setup`` installs them) or namespaces cannot be made."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_magic.runner import launch

from hvd_magic.runner import slurm as plan
from hvd_magic.runner.plan import Host


HERE = Path(__file__).parent
ROOT = HERE.parent
PY = sys.executable


@pytest.fixture(scope="module")
def cluster():
    import slurm_cluster
    why = slurm_cluster.unusable_reason()
    if why:
        pytest.skip(why)
    try:
        info = launch.detect_mpi(launch.find_mpiexec())
    except launch.MpiNotFoundError as exc:
        pytest.skip(str(exc))
    if info.impl != "openmpi":
        pytest.skip(f"the pool uses PRRTE's Slurm support (Open MPI 5); this is {info.impl}")
    slurm_cluster.clean_stale()
    c = slurm_cluster.SlurmCluster().create()
    try:
        yield c
    finally:
        left = c.destroy()
        # the daemons' own helpers (slurmscriptd, a step's slurmstepd) may be among them;
        # nothing of ours (python, prted, mpiexec) may be
        ours = [p for p in left if "python" in p or "prte" in p]
        assert not ours, f"left running on the Slurm nodes: {ours}"


# ---------------------------------------------------------------- deciding (no Slurm needed)
JOB = """\
JobId=42 JobName=hvd_magic
   JobState=RUNNING Reason=None Dependency=(null)
   RunTime=00:00:03 TimeLimit=00:10:00 TimeMin=N/A
   NodeList=gpu[01-02],cpu7
   NumNodes=3 NumCPUs=5 NumTasks=5 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
     Nodes=gpu[01-02] CPU_IDs=0-1 Mem=0 GRES=
     Nodes=cpu7 CPU_IDs=3 Mem=0 GRES=
   Command=(null)
   Power=
"""


def test_salloc_arguments_and_the_job_id():
    req = plan.SlurmRequest(partition="gpu", time="1:00:00", nodes=2, gpus_per_node=4)
    assert plan.salloc_argv(req, 8) == [
        "salloc", "--no-shell", "--job-name=hvd_magic", "--ntasks=8", "--nodes=2",
        "--partition=gpu", "--time=1:00:00", "--gpus-per-node=4"]
    assert plan.salloc_argv(plan.SlurmRequest(), 2) == [
        "salloc", "--no-shell", "--job-name=hvd_magic", "--ntasks=2"]
    assert plan.parse_job_id("salloc: Pending job allocation 7\nsalloc: job 7 queued\n"
                             "salloc: Granted job allocation 7\n") == 7
    with pytest.raises(ValueError, match="Invalid partition"):
        plan.parse_job_id("salloc: error: Job submit/allocate failed: Invalid partition")
    for bad, words in ((plan.SlurmRequest(time="soon"), "Slurm's formats"),
                       (plan.SlurmRequest(nodes=0), "--nodes 0"),
                       (plan.SlurmRequest(partition="a b"), "partition name"),
                       (plan.SlurmRequest(gpus_per_node=True), "--gpus-per-node")):
        with pytest.raises(ValueError, match=words):
            plan.salloc_argv(bad, 4)
    with pytest.raises(ValueError, match="more nodes than ranks"):
        plan.salloc_argv(plan.SlurmRequest(nodes=3), 2)
    for ok in ("30", "10:00", "1:00:00", "2-12", "2-12:30", "1-0:0:0", "UNLIMITED"):
        plan.check_request(plan.SlurmRequest(time=ok))


def test_reading_a_job_and_the_variables_open_mpi_needs():
    job = plan.parse_job_detail(JOB)
    assert (job.job_id, job.state, job.nodelist) == (42, "RUNNING", "gpu[01-02],cpu7")
    assert job.hosts == [Host("gpu01", 2), Host("gpu02", 2), Host("cpu7", 1)]
    env = plan.job_env(job)
    assert env["SLURM_JOBID"] == env["SLURM_JOB_ID"] == "42"
    assert env["SLURM_NODELIST"] == env["SLURM_JOB_NODELIST"] == "gpu[01-02],cpu7"
    assert env["SLURM_TASKS_PER_NODE"] == "2(x2),1"
    assert env["SLURM_NNODES"] == "3"
    with pytest.raises(ValueError, match="no job"):
        plan.parse_job_detail("slurm_load_jobs error: Invalid job id specified")


def test_host_lists_and_task_counts():
    assert plan.expand_hostlist("n[01-03,7],gpu1") == ["n01", "n02", "n03", "n7", "gpu1"]
    assert plan.expand_hostlist("sn12-[1-2]") == ["sn12-1", "sn12-2"]
    assert plan.expand_hostlist("a") == ["a"]
    assert plan.compress_counts([2, 2, 1]) == "2(x2),1"
    assert plan.compress_counts([4]) == "4"
    assert plan.expand_counts("2(x2),1") == [2, 2, 1]
    assert plan.count_cpu_ids("0-1,4") == 3
    with pytest.raises(ValueError):
        plan.expand_counts("two")


def test_inside_an_allocation_it_is_used_as_is():
    assert plan.allocation_from_env({}) is None
    assert plan.allocation_from_env({"SLURM_JOB_ID": "9"}) is None
    job = plan.allocation_from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]",
                                    "SLURM_TASKS_PER_NODE": "3(x2)"})
    assert job.job_id == 9 and job.hosts == [Host("n1", 3), Host("n2", 3)]
    with pytest.raises(ValueError, match="does not match"):
        plan.allocation_from_env({"SLURM_JOB_ID": "9", "SLURM_NODELIST": "n[1-2]",
                                  "SLURM_TASKS_PER_NODE": "3"})


def test_failure_text_names_the_node():
    nodes = plan.parse_nodes(
        "NodeName=n1 NodeAddr=10.0.0.1 State=IDLE Partitions=debug\n"
        "NodeName=n2 NodeAddr=10.0.0.2 OS=Linux 6.1 #1 SMP State=DOWN+DRAIN Partitions=debug "
        "Reason=bad disk [root@2026-11-25T11:59:02]\n")
    assert nodes["n2"]["NodeAddr"] == "10.0.0.2" and nodes["n2"]["OS"] == "Linux 6.1 #1 SMP"
    job = plan.parse_job_detail(JOB.replace("RUNNING Reason=None", "NODE_FAIL Reason=NodeDown"))
    text = plan.failure_text(job, nodes, ["n1", "n2"], 42)
    assert text.startswith("the Slurm allocation (job 42) ended (NODE_FAIL): node n2 "
                           "(DOWN+DRAIN: bad disk) is out of service")
    healthy = plan.parse_job_detail(JOB)
    assert plan.failure_text(healthy, {"n1": {"State": "ALLOCATED"}}, ["n1"], 42) == ""
    timeout = plan.parse_job_detail(JOB.replace("RUNNING Reason=None",
                                                "TIMEOUT Reason=TimeLimit"))
    assert "ended (TIMEOUT): TimeLimit" in plan.failure_text(timeout, {}, ["n1"], 42)
    assert "ended (gone)" in plan.failure_text(None, {}, [], 42)


def test_a_pool_in_an_allocation_is_planned_as_multi_host():
    from hvd_magic.kernel.notebook.plan import PoolConfig, plan_pool
    hosts = [Host("n1", 2), Host("n2", 2)]
    environ = {"PATH": "/usr/bin", "SLURM_JOB_ID": "42", "SLURM_NODELIST": "n[1-2]"}
    cfg = PoolConfig(np=4, workdir="/tmp/hvdm-x", key="k", hosts=hosts, slurm_job=42,
                     controller_ip="10.0.0.1", ports=list(range(5000, 5030)), netns=True,
                     environ=environ, local_names=frozenset({"localhost", "n1", "n2"}))
    p = plan_pool(cfg)
    assert not p.single_host
    assert "hvd_magic.runner.netns" not in " ".join(p.engine_argv)
    assert p.engine_argv[p.engine_argv.index("-H") + 1] == "n1:2,n2:2"
    assert p.engine_env["SLURM_JOB_ID"] == "42"
    assert "SLURM_JOB_ID" not in p.engine_argv            # PRRTE's, not the ranks'
    assert any("Slurm job 42" in n for n in p.notes)
    other = PoolConfig(**{**cfg.__dict__, "slurm_job": 43})
    assert other.key_fields() != cfg.key_fields()


# ---------------------------------------------------------------- doing, on a real Slurm
def _result(proc: subprocess.CompletedProcess, cluster) -> dict:
    why = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}\n{cluster.logs()}"
    assert proc.returncode == 0, why
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, why
    return json.loads(lines[0][len("RESULT "):])


def _scenario(cluster, name: str, timeout: float = 90, **env: str) -> dict:
    proc = cluster.run([PY, str(HERE / "mpi" / "slurm_pool.py"), name, cluster.nodes[1]],
                       timeout=timeout, check=False, cwd=str(ROOT), env=cluster.env(**env))
    return _result(proc, cluster)


@pytest.mark.slow
@pytest.mark.multihost
def test_pool_on_slurm_trains_across_two_nodes_and_stop_releases_the_job(cluster):
    """%%hvd -np 4 --slurm --nodes 2: salloc, the pool's ranks on both nodes (two per
    node), a small torch model trained (same weights everywhere, loss down); squeue shows
    the job while the pool lives; later cells reuse the pool and the job; %hvd stop cancels
    the job."""
    t0 = time.monotonic()
    res = _scenario(cluster, "cells")
    took = time.monotonic() - t0
    n1, n2 = cluster.nodes
    first = res["first"]
    assert [first[str(r)][:3] for r in range(4)] == [[n1, 0, 4], [n1, 1, 4], [n2, 2, 4],
                                                   [n2, 3, 4]]
    weights = {json.dumps(v[5]) for v in first.values()}
    assert len(weights) == 1, "the ranks' models differ after DistributedOptimizer steps"
    assert all(v[4] < v[3] / 10 for v in first.values()), first
    assert res["hosts"] == [f"{n1}:2", f"{n2}:2"]
    assert res["squeue_live"] == [f"{res['job']} RUNNING"]
    assert res["same_pool"] and res["same_job"] and res["same_pool_3"]
    assert res["second"] == {str(r): [r, 4] for r in range(4)}
    assert res["third"] == {str(r): 4.0 for r in range(4)}
    assert f"slurm: job {res['job']} on {n1}:2, {n2}:2" in res["printed"]
    assert f"hvd: Slurm job {res['job']} released" in res["printed"]
    assert res["squeue_after"] == []
    assert cluster.wait_no_jobs(5) == []
    assert took < 60


@pytest.mark.slow
@pytest.mark.multihost
def test_a_node_taken_down_ends_the_cell_naming_the_node(cluster):
    """scontrol update nodename=N2 state=down while a cell runs: the cell ends within 10 s
    with an error naming N2; stop leaves no job."""
    try:
        res = _scenario(cluster, "nodedown")
    finally:
        cluster.set_state(1, "resume")
    n2 = cluster.nodes[1]
    assert res["error_type"] is not None, res
    assert res["ended_after_s"] < 10, res
    assert n2 in res["error"] and "DOWN" in res["error"], res["error"]
    assert n2 in res["stderr"]
    assert res["squeue_after"] == []
    cluster.wait_idle(15)


@pytest.mark.slow
@pytest.mark.multihost
def test_kernel_exit_and_kernel_killed_release_the_job(cluster):
    """The kernel exits without %hvd stop (atexit), or is killed with SIGKILL (the
    watcher process): in both cases squeue is empty soon after."""
    res = _scenario(cluster, "exit")
    assert res["squeue_live"] == [f"{res['job']} RUNNING"]
    assert cluster.wait_no_jobs(5) == []
    proc = subprocess.Popen(cluster.on_node([PY, str(HERE / "mpi" / "slurm_pool.py"),
                                             "killed", cluster.nodes[1]]),
                            env=cluster.env(), cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("READY ") or not line:
                break
        assert line.startswith("READY "), proc.stderr.read() if proc.poll() is not None else ""
        ready = json.loads(line[len("READY "):])
        assert ready["squeue_live"] == [f"{ready['job']} RUNNING"]
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=10)
        assert cluster.wait_no_jobs(10) == []
        assert time.monotonic() - t0 < 5
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate(timeout=10)


def _ranks(text: str) -> list:
    return sorted((json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("RANK ")),
                  key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.multihost
def test_hvdrun_inside_salloc_uses_the_allocation(cluster):
    """salloc -N2 -n4 hvdrun -np 4 ...: no host options, the job's nodes are used as they
    are (two ranks on each)."""
    hvdrun = [PY, "-m", "hvd_magic.runner.cli", "-np", "4", "python",
              str(HERE / "mpi" / "multihost_rank.py")]
    proc = cluster.run(["salloc", "-N2", "-n4", *hvdrun], timeout=60, check=False,
                       cwd=str(ROOT))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    ranks = _ranks(proc.stdout)
    n1, n2 = cluster.nodes
    assert [r["host"] for r in ranks] == [n1, n1, n2, n2], proc.stdout
    assert all(r["sum"] == 10.0 and r["size"] == 4 for r in ranks)
    assert "using this Slurm job" in proc.stderr
    assert cluster.wait_no_jobs(5) == []


@pytest.mark.slow
@pytest.mark.multihost
def test_hvdrun_slurm_gets_and_releases_an_allocation(cluster):
    proc = cluster.run([PY, "-m", "hvd_magic.runner.cli", "-np", "2", "--slurm", "--nodes",
                        "2", "--time", "5", "python", str(HERE / "mpi" / "multihost_rank.py")],
                       timeout=60, check=False, cwd=str(ROOT))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert [r["host"] for r in _ranks(proc.stdout)] == cluster.nodes
    assert "released" in proc.stderr
    assert cluster.wait_no_jobs(5) == []


@pytest.mark.slow
@pytest.mark.multihost
def test_the_idle_timeout_releases_the_job(cluster):
    """HVD_MAGIC_SLURM_IDLE_TIMEOUT=2: a cell restarts the clock; 2 s without one stop the
    pool and cancel the job."""
    res = _scenario(cluster, "idle")
    live = [f"{res['job']} RUNNING"]
    assert res["squeue_live"] == live and res["squeue_after_cell"] == live
    assert res["squeue_idle"] == [] and res["pool_gone"]
    assert res["idle_after_s"] >= 2.0          # not before the timeout


PROFILE = """\
description = "the test cluster"
scheduler = "slurm"
processes_per_host = 1
setup = ["echo x > {d}/$(hostname).1 && sleep 0.3",
         "ls {d} | grep -c '[.]1$' > {d}/$(hostname).seen"]

[slurm]
nodes = 2
time = "5"

[env]
HVD_TEST_MARK = "from-profile"
"""


@pytest.mark.slow
@pytest.mark.multihost
def test_a_profile_runs_its_setup_on_every_node_then_the_pool(cluster, tmp_path):
    """%%hvd --profile slurm2: its setup lines ran on both nodes in order, the second only
    after both had run the first (each saw 2 files); one rank per node; its [env] reached
    the ranks; %hvd profiles lists it. hvdrun --profile does the same for a script."""
    out = Path(cluster.dir) / "setup-out"
    out.mkdir()
    profiles = Path(cluster.dir) / "profiles"
    profiles.mkdir()
    (profiles / "slurm2.toml").write_text(PROFILE.format(d=out))
    res = _scenario(cluster, "profile", HVD_MAGIC_PROFILE_DIR=str(profiles))
    n1, n2 = cluster.nodes
    assert "slurm2" in res["profiles"] and "slurm nodes=2 time=5" in res["profiles"]
    assert "2 setup line(s)" in res["profiles"] and "the test cluster" in res["profiles"]
    assert res["where"] == {"0": [n1, "from-profile"], "1": [n2, "from-profile"]}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n1}.1", f"{n2}.1", f"{n1}.seen", f"{n2}.seen"])
    assert [(out / f"{n}.seen").read_text().strip() for n in (n1, n2)] == ["2", "2"]
    assert res["squeue_after"] == []
    for p in out.iterdir():
        p.unlink()
    proc = cluster.run([PY, "-m", "hvd_magic.runner.cli", "--profile", "slurm2", "python",
                        str(HERE / "mpi" / "multihost_rank.py")], timeout=60, check=False,
                       cwd=str(ROOT), env=cluster.env(HVD_MAGIC_PROFILE_DIR=str(profiles)))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert [r["host"] for r in _ranks(proc.stdout)] == [n1, n2]
    assert "setup 2/2" in proc.stderr and (out / f"{n2}.seen").read_text().strip() == "2"
    assert cluster.wait_no_jobs(5) == []
