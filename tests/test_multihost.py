"""Multi-host runs for real: two network namespaces on this machine act as two hosts.

Host A (10.231.0.1) runs the launcher side (hvdrun, hvd_magic.run, the notebook kernel
with the pool's controller); host B (10.231.0.2) is reached only through PRRTE's ssh agent,
which behaves like ssh to another machine (see netns_hosts.py): its own hostname, its own
/tmp, a bare environment, the daemon detached from mpiexec. Needs root and `ip netns`;
skipped elsewhere.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from hvd_magic.runner import launch

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

HERE = Path(__file__).parent
PY = sys.executable


@pytest.fixture(scope="module", autouse=True)
def _open_mpi():
    try:
        info = launch.detect_mpi(launch.find_mpiexec())
    except launch.MpiNotFoundError as exc:
        pytest.skip(str(exc))
    if info.impl != "openmpi":
        pytest.skip(f"the ssh stand-in is set through PRRTE (Open MPI 5); this is {info.impl}")


def _records(text: str, prefix: str) -> list:
    return [json.loads(line[len(prefix):]) for line in text.splitlines()
            if line.startswith(prefix)]


def _check_two_hosts(ranks: list, hosts) -> None:
    """Rank r ran on host r, alone there: two hostnames, local_size 1, cross_size 2."""
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["host"] for r in ranks] == [hosts.a.ns, hosts.b.ns]
    for r in ranks:
        assert (r["local_size"], r["cross_size"], r["cross_rank"]) == (1, 2, r["rank"])


def test_hvdrun_across_two_hosts(two_hosts):
    t0 = time.monotonic()
    proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "--verbose", "-np", "2",
                          "-H", two_hosts.hosts_arg, "--network-interface", "10.231.0.0/24",
                          "python", str(HERE / "mpi" / "multihost_rank.py")], timeout=30)
    took = time.monotonic() - t0
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert proc.returncode == 0, why
    ranks = sorted(_records(proc.stdout, "RANK "), key=lambda r: r["rank"])
    assert len(ranks) == 2, why
    _check_two_hosts(ranks, two_hosts)
    for r in ranks:
        assert r["size"] == 2 and r["local_rank"] == 0
        assert r["sum"] == 3.0                              # 1 + 2
        assert r["hosts"] == [two_hosts.a.ns, two_hosts.b.ns]
        # the bare remote shell's PATH was replaced by this one's: `python` is this venv's
        assert r["path"].split(os.pathsep)[0] == os.path.dirname(PY)
    assert "multiple hosts" in proc.stderr
    assert "prte_if_include 10.231.0.0/24" in proc.stderr
    assert "GLOO_SOCKET_IFNAME" not in proc.stderr           # a subnet is no interface name
    assert "10.231.0.2" in two_hosts.agent_calls()          # B was reached through the agent
    assert not two_hosts.leftovers(wait=3.0)
    assert took < 30


def test_hvdrun_with_a_hostfile(two_hosts, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{two_hosts.a.ip} slots=1\n{two_hosts.b.ip} slots=1\n")
    proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "-np", "2", "--hostfile",
                          str(hostfile), "python", str(HERE / "mpi" / "multihost_rank.py")],
                         timeout=30)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    _check_two_hosts(sorted(_records(proc.stdout, "RANK "), key=lambda r: r["rank"]), two_hosts)
    assert not two_hosts.leftovers(wait=3.0)


def test_gloo_across_two_hosts(two_hosts):
    """HOROVOD_CPU_OPERATIONS=gloo (the torch.distributed path that CUDA tensors take with
    NCCL) across hosts whose names do not resolve: rank 0's rendezvous address comes from
    the interface named by --network-interface, or by a GLOO_SOCKET_IFNAME set here (which
    must reach host B); with neither, every rank fails at once, saying what to set."""
    pytest.importorskip("torch")
    script = str(HERE / "mpi" / "multihost_rank.py")
    base = [PY, "-m", "hvd_magic.runner.cli", "-np", "2", "-H", two_hosts.hosts_arg]
    gloo = two_hosts.env(HOROVOD_CPU_OPERATIONS="gloo", HVD_MAGIC_TORCH_INIT_TIMEOUT="20")
    for argv, env in ((base + ["--network-interface", "hvd0"], gloo),
                      (base, dict(gloo, GLOO_SOCKET_IFNAME="hvd0"))):
        proc = two_hosts.run(argv + ["python", script], env=env, timeout=40)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        ranks = sorted(_records(proc.stdout, "RANK "), key=lambda r: r["rank"])
        _check_two_hosts(ranks, two_hosts)
        assert [r["sum"] for r in ranks] == [3.0, 3.0]
    t0 = time.monotonic()
    proc = two_hosts.run(base + ["python", script], env=gloo, timeout=40)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30
    assert "HVD_MAGIC_RENDEZVOUS_ADDR" in proc.stderr and "does not resolve" in proc.stderr
    assert not two_hosts.leftovers(wait=3.0)


def test_run_function_across_two_hosts(two_hosts):
    """hvd_magic.run with hosts: results in rank order, a rank's exception on B raised here
    as RankError; without a shared TMPDIR it fails saying what to set."""
    proc = two_hosts.run([PY, str(HERE / "mpi" / "multihost_run.py"), two_hosts.hosts_arg,
                          two_hosts.shared], timeout=60)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{two_hosts.agent_calls()}"
    (res,) = _records(proc.stdout, "RESULT ")
    good = res["good"]
    _check_two_hosts(good, two_hosts)
    assert [r["sum"] for r in good] == [21.0, 21.0]         # 10 + 11
    failed = res["failed"]
    assert failed is not None, "rank 1 raised on host B but run() returned"
    assert failed["rank"] == 1
    assert f"ValueError: boom on {two_hosts.b.ns}" in failed["message"]
    assert "fail_on" in failed["traceback"]
    # the temporary directory in A's own /tmp: B cannot see it, and the error says so
    unshared = res["unshared"]
    assert unshared is not None and "cannot see" in unshared and "TMPDIR" in unshared, unshared
    assert not two_hosts.leftovers(wait=3.0)


def _pool_scenario(hosts, scenario: str, **env: str) -> dict:
    """Run tests/mpi/multihost_pool.py SCENARIO on host A; its RESULT record."""
    open(hosts.agent_log, "w").close()              # agent_calls(): this scenario's only
    proc = hosts.run([PY, str(HERE / "mpi" / "multihost_pool.py"), scenario, hosts.hosts_arg,
                      hosts.a.ns, hosts.b.ns], env=hosts.env(**env), timeout=60)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{hosts.agent_calls()}"
    assert proc.returncode == 0, why
    records = _records(proc.stdout, "RESULT ")
    assert len(records) == 1, why
    return records[0]


def test_pool_across_two_hosts_through_the_magics(two_hosts):
    """%%hvd -np 2 -H A:1,B:1 in a real IPython shell on host A: allreduce across the
    hosts, state kept between cells, a timed-out cell interrupted on both hosts (through
    the nannies), the controller reachable on A's address only, and %hvd stop leaves
    nothing running on either host."""
    t0 = time.monotonic()
    # the pool has no --network-interface: Open MPI's variables in the kernel's environment
    res = _pool_scenario(two_hosts, "magics", OMPI_MCA_btl_tcp_if_include="10.231.0.0/24",
                         PRTE_MCA_prte_if_include="10.231.0.0/24")
    took = time.monotonic() - t0
    a, b = two_hosts.a.ns, two_hosts.b.ns
    # first cell: each rank on its own host, alone there; allreduce of 1 and 2; Open MPI's
    # variables reached the rank on B and B's daemon
    net = "10.231.0.0/24"
    assert res["first"] == {"0": [a, 0, 1, 2, [3.0] * 3, net], "1": [b, 1, 1, 2, [3.0] * 3, net]}
    assert f'prte_if_include "{net}"' in two_hosts.agent_calls()
    assert not res["single_host"]
    # second cell sees the first one's w on both hosts: 3 + (3 + 3)
    assert res["second"] == {"0": [a, [9.0] * 3], "1": [b, [9.0] * 3]}
    # --timeout 1: interrupted on both ranks, runtime reset, same pool, state still there
    assert res["timeout"].startswith("PoolCellTimeout") and "the pool is ready" in res["timeout"]
    assert res["timeout_s"] < 8
    assert res["same_pool"] and res["third"] == res["second"]
    # %hvd status names both hosts
    assert a in res["status"] and b in res["status"]
    # the engines' side of the controller: on A's veth address only, never a wildcard
    assert res["engine_interface"] == f"tcp://{two_hosts.a.ip}"
    listen = [tuple(x) for x in res["controller_listen"]]
    assert (two_hosts.a.ip, res["registration_port"]) in listen, listen
    assert not [x for x in listen if x[0] in ("0.0.0.0", "::", "")], listen
    assert {ip for ip, _ in listen} <= {two_hosts.a.ip, "127.0.0.1"}, listen
    # stop: nothing left on either host, soon (a remote nanny used to linger ~3 s)
    assert res["left"] == [] and res["workdir_gone"], res["lingered"]
    assert res["empty_after_s"] < 2.5, res["lingered"]
    assert not two_hosts.leftovers(wait=2.0)
    assert took < 45


def test_hvd_stacks_on_a_pool_across_two_hosts_shows_the_rank_on_the_other_host(two_hosts):
    """%hvd stacks while a cell runs on host A and host B: both ranks' stacks, each with the
    line it runs, within the 2 s gathering time; the cell goes on and ends."""
    res = _pool_scenario(two_hosts, "stacks")
    text = res["text"]
    assert "hvd: the stacks of 2 rank(s)" in text and "no stack" not in text, text
    # the lines of the cell (multihost_pool.STACKS_CELL) each rank runs
    assert re.search(r"rank 0: runs \S+:8 \(in <module>\), not in a collective", text), text
    assert re.search(r"rank 1: runs \S+:5 \(in <module>\), not in a collective", text), text
    assert "--- rank 1 ---" in text, text
    assert res["running"] and res["cell_ok"], res
    # the marked lines rank 1 answered with stay out of the cell's output
    assert "finished 1" in res["output"] and "[hvd_magic stacks" not in res["output"], res
    assert res["took_s"] < 5, res["took_s"]
    assert res["left"] == [], res["lingered"]


def test_pool_oversubscribed_across_two_hosts(two_hosts):
    """HVD_MAGIC_OVERSUBSCRIBE=1, -np 3 on -H A:1,B:1: by slot, then round again (A, B, A
    would also do; what must not happen is every rank on A)."""
    res = _pool_scenario(two_hosts, "oversubscribe")
    a, b = two_hosts.a.ns, two_hosts.b.ns
    assert res["policy"] == "slot:oversubscribe"
    ranks = {r: ast.literal_eval(v) for r, v in res["ranks"].items()}
    hosts = [ranks[r][0] for r in ("0", "1", "2")]
    assert sorted(hosts) == [a, a, b], hosts
    for host, local_rank, local_size, total in ranks.values():
        assert local_size == hosts.count(host) and total == 3.0
    assert res["left"] == [] and res["empty_after_s"] < 2.5, res["lingered"]
    assert not two_hosts.leftovers(wait=2.0)


#: What Open MPI's launcher prints when its add-host spawn goes wrong: the error it logs in
#: PRRTE's spawn/connect code, then glibc's report of the heap corruption that follows.
PRRTE_ADD_HOST_CRASH = re.compile(r"pmix_server_dyn\.c[\s\S]*(free\(\)|malloc\(\)|corrupted|"
                                  r"event_queue_remove_active)")


def test_elastic_growth_starts_the_new_rank_on_the_host_the_discovery_script_added(two_hosts):
    # Horovod's semantics: the discovery script names the hosts; a rank that joins starts on
    # one with a free slot (host B here, which the job did not have at its start)
    slots = Path(two_hosts.shared) / "slots"
    slots.write_text(f"{two_hosts.a.ip}:1\n")
    script = Path(two_hosts.shared) / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {slots}\n")
    script.chmod(0o755)
    proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "-np", "1", "--min-np", "1",
                          "--max-np", "2", "-H", f"{two_hosts.a.ip}:1", "--network-interface",
                          "10.231.0.0/24", "--host-discovery-script", str(script), "python",
                          str(HERE / "mpi" / "elastic_hosts.py"), str(slots), two_hosts.b.ip],
                         timeout=60)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    if proc.returncode != 0 and PRRTE_ADD_HOST_CRASH.search(proc.stderr):
        # Open MPI 5.0.11's launcher corrupts its heap after the error it logs while
        # connecting the ranks of a spawn onto an added host (PRRTE, not this project: its
        # add-host path is not in PRRTE's own tests); rare before 2026-11-28, then 4 runs in
        # 5 here, on this project's code of the day before too
        pytest.xfail("Open MPI's launcher crashed in its add-host spawn (PRRTE: "
                     "pmix_server_dyn.c, then a heap error)")
    assert proc.returncode == 0, why
    ranks = sorted(_records(proc.stdout, "RANK "), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["host"]) for r in ranks] == [
        (0, 2, two_hosts.a.ns), (1, 2, two_hosts.b.ns)], why
    assert all(r["unequal"] == [] and r["step"] == 12 for r in ranks), why
    assert ranks[0]["sum"] == ranks[1]["sum"], why
    assert "hosts updated, 1 rank(s) joined; continuing on 2 rank(s) from commit 2" in proc.stderr, why



def test_sigusr1_to_hvdrun_shows_the_stack_of_a_rank_on_another_host(two_hosts):
    """Rank 1 runs on host B, where hvdrun's stacks directory does not exist (B has its own
    /tmp): it answers the question on its stderr, each line marked, and hvdrun shows its
    stack beside rank 0's, the marked lines taken out of the job's output."""
    from test_stacks import SCRIPT, _assert_both_ranks, sigusr1_stacks
    env = two_hosts.env(HOROVOD_STALL_CHECK_DISABLE="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="8")
    rc, err = sigusr1_stacks(two_hosts.wrap([PY, "-m", "hvd_magic.runner.cli", "-np", "2", "-H",
                                             two_hosts.hosts_arg, "--network-interface",
                                             "10.231.0.0/24", "python", str(SCRIPT), "usr1"]),
                             env, ready_s=60)
    assert rc == 0, err
    assert "hvdrun: the stacks of 2 rank(s)" in err, err
    _assert_both_ranks(err, submits=None)
    assert "[hvd_magic stacks of rank" not in err, err
    assert not two_hosts.leftovers(wait=3.0)


def test_a_stall_across_hosts_shows_the_stack_of_the_rank_on_the_other_host(two_hosts):
    """Rank 0 (on hvdrun's host) warns of the stall and shows its own stack; it asks hvdrun
    for the others', and hvdrun shows rank 1's, from host B, with the line it waits on."""
    from test_stacks import SCRIPT, STALL, _assert_both_ranks
    proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "-np", "2", "-H",
                          two_hosts.hosts_arg, "--network-interface", "10.231.0.0/24",
                          "python", str(SCRIPT), "mismatch"], env=two_hosts.env(**STALL),
                         timeout=60)
    err = proc.stderr
    assert proc.stdout.count("stall_stacks OK") == 2, proc.stdout + err
    assert "WARNING: stall" in err and "hvdrun gathers the stacks of the ranks on other hosts" \
        in err, err
    hvdrun = err[err.index("hvdrun: the stacks of 2 rank(s)"):]
    _assert_both_ranks(hvdrun, submits=None)
    assert not two_hosts.leftovers(wait=3.0)


def test_a_rank_on_another_host_spinning_in_c_holding_the_gil_still_gives_its_stack(two_hosts):
    """Rank 1 runs on host B in one long C call that holds the GIL, so its Python handler
    cannot answer, and hvdrun's real-time signal cannot reach B. The watcher process the rank
    started at hvd.init() hears the forwarded signal, has faulthandler dump the stacks from C
    and marks the lines: hvdrun shows rank 1 in the C call."""
    from test_stacks import SCRIPT, line_of
    proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "-np", "2", "-H",
                          two_hosts.hosts_arg, "--network-interface", "10.231.0.0/24",
                          "python", str(SCRIPT), "gil"],
                         env=two_hosts.env(HOROVOD_STALL_CHECK_TIME_SECONDS="1"), timeout=60)
    err = proc.stderr
    assert proc.stdout.count("stall_stacks OK") == 2, proc.stdout + err
    hvdrun = err[err.index("hvdrun: the stacks of 2 rank(s)"):]
    spin = line_of("SPIN-IN-C")
    assert f"rank 1: runs {SCRIPT}:{spin} (in spin_in_c), not in a collective" in hvdrun, err
    # (rank 1's Python handler could answer only after its 6 s call: this answer is from C)
    assert "[hvd_magic stacks of rank" not in err, err
    assert not two_hosts.leftovers(wait=3.0)
