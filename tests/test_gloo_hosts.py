"""``hvdrun --gloo -H ...``: ranks started on several hosts over ssh with no MPI.

The plan (which rank goes where, with which variables and command line) is checked as a
pure function; then real jobs run across two network-namespace hosts (tests/netns_hosts.py:
host B is reached only through the ssh stand-in, with its own hostname, /tmp and a bare
environment): the README's example trains to the weights `hvdrun -np 2` (MPI) gives, and
a rank killed on host B ends the job, named, with nothing left running on either host.
Once more with a real OpenSSH server on host B and the real ssh client as the agent; and
`torchrun` itself across the two hosts.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_magic.runner.gloo_plan import DEFAULT_AGENT, agent_command, exit_text, place, \
    plan_hosts
from hvd_magic.runner.plan import Host, LaunchArgs

HERE = Path(__file__).parent
PY = sys.executable


def _args(hosts: str, np_: int, **kw) -> LaunchArgs:
    from hvd_magic.runner.plan import parse_hosts
    return LaunchArgs(np=np_, command=["python", "train.py"], hosts=parse_hosts(hosts), **kw)


# ------------------------------------------------------------------------------- the plan
def test_ranks_are_placed_host_by_host_with_horovods_local_and_cross_ranks():
    got = [(p.rank, p.host, p.host_index, p.local_rank, p.local_size, p.cross_rank,
            p.cross_size) for p in place([Host("a", 2), Host("b", 2)], 4)]
    assert got == [(0, "a", 0, 0, 2, 0, 2), (1, "a", 0, 1, 2, 0, 2),
                   (2, "b", 1, 0, 2, 1, 2), (3, "b", 1, 1, 2, 1, 2)]
    # fewer ranks than slots: hosts fill in order, an unused host is left out; the cross
    # ranks are Horovod's (among the ranks with the same local rank)
    got = [(p.host, p.local_rank, p.local_size, p.cross_rank, p.cross_size)
           for p in place([Host("a", 2), Host("b", 2), Host("c", 1)], 3)]
    assert got == [("a", 0, 2, 0, 2), ("a", 1, 2, 0, 1), ("b", 0, 1, 1, 2)]
    # past the slots (--oversubscribe): one more per host in turn, numbered host by host
    assert [p.host for p in place([Host("a", 1), Host("b", 1)], 5)] == ["a"] * 3 + ["b"] * 2


def _remote_env(line: str) -> dict:
    """The variables a remote rank's shell line sets (``cd DIR; exec env K=V ... CMD``)."""
    words = shlex.split(line)
    start = words.index("env") + 1
    out = {}
    for w in words[start:]:
        if "=" not in w or w.startswith("-"):
            break
        k, v = w.split("=", 1)
        out[k] = v
    return out


def test_the_plan_starts_remote_ranks_through_the_agent_with_their_variables():
    env = {"PATH": "/usr/bin", "HOME": "/root", "SECRET": "x", "HOROVOD_TIMELINE": "/t.json",
           "NCCL_DEBUG": "INFO", "OMPI_COMM_WORLD_SIZE": "9", "PMIX_RANK": "3",
           "PRTE_MCA_plm_ssh_agent": "/opt/agent -x : rsh"}
    starts = plan_hosts(_args("node1:2,node2:1", 3, network_interface="eth0",
                              fusion_threshold_mb=1.0), env, cwd="/work dir", port=29411,
                        store_here=False, local_names=frozenset({"localhost"}),
                        python="/venv/bin/python")
    assert [(s.place.rank, s.place.host, s.remote) for s in starts] == [
        (0, "node1", True), (1, "node1", True), (2, "node2", True)]
    for s in starts:
        # the agent PRRTE would use (its first choice), then the host, then one shell line
        assert s.argv[:3] == ["/opt/agent", "-x", s.place.host] and len(s.argv) == 4
        line = s.argv[3]
        assert line.startswith("cd '/work dir' 2>/dev/null; exec env ")
        assert line.endswith("/venv/bin/python -m hvd_magic.runner.gloo_nanny -- python train.py")
        got = _remote_env(line)
        p = s.place
        assert {k: got[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                    "MASTER_PORT", "HOROVOD_CROSS_RANK", "HOROVOD_CONTROLLER")} \
            == {"RANK": str(p.rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(p.local_rank),
                "LOCAL_WORLD_SIZE": str(p.local_size), "GROUP_RANK": str(p.host_index),
                "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29411",
                "HOROVOD_CROSS_RANK": str(p.cross_rank), "HOROVOD_CONTROLLER": "gloo"}
        # the flags' variables and the forwarded ones; the venv's bin first on PATH; no
        # MPI launcher's variable, nothing else of this environment
        assert got["HOROVOD_FUSION_THRESHOLD"] == str(1024 * 1024)
        assert got["GLOO_SOCKET_IFNAME"] == got["NCCL_SOCKET_IFNAME"] == "eth0"
        assert got["HOROVOD_TIMELINE"] == "/t.json" and got["NCCL_DEBUG"] == "INFO"
        assert got["PATH"] == "/venv/bin:/usr/bin"
        assert not {"SECRET", "HOME", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"} & set(got)
        # rank 0 keeps the store (hvdrun is not on the first host)
        assert "TORCHELASTIC_USE_AGENT_STORE" not in got
        assert s.env == env           # the agent itself runs in hvdrun's environment


def test_a_rank_on_this_machine_starts_directly_and_the_store_may_be_hvdruns():
    env = {"PATH": "/usr/bin", "HOME": "/root", "OMPI_MCA_btl": "self"}
    starts = plan_hosts(_args("me:1,other:1", 2), env, cwd="/w", port=5000, store_here=True,
                        local_names=frozenset({"me", "localhost"}), python="/v/bin/python")
    here, there = starts
    assert not here.remote and here.argv == ["/v/bin/python", "-m", "hvd_magic.runner.gloo_nanny",
                                             "--", "python", "train.py"]
    assert here.env["HOME"] == "/root" and "OMPI_MCA_btl" not in here.env
    assert here.env["RANK"] == "0" and here.env["MASTER_ADDR"] == "me"
    assert here.env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert there.remote and there.argv[:len(DEFAULT_AGENT)] == list(DEFAULT_AGENT)
    assert _remote_env(there.argv[-1])["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_localhost_first_among_other_hosts_is_refused_saying_what_to_write():
    with pytest.raises(ValueError, match="the other hosts cannot reach it by that name"):
        plan_hosts(_args("localhost:1,node2:1", 2), {}, cwd="/", port=1, store_here=True)


def test_the_agent_and_the_end_of_a_rank_in_words():
    assert agent_command({}) == list(DEFAULT_AGENT)
    assert agent_command({"OMPI_MCA_plm_rsh_agent": "rsh"}) == ["rsh"]
    assert exit_text(0, None) == ("exited with status 0", 0)
    assert exit_text(3, None) == ("exited with status 3", 3)
    assert exit_text(-9, None) == ("was killed by signal 9", 137)
    what, code = exit_text(None, 255)
    assert code == 255 and "connection ended" in what and "status 255" in what


def test_hvdrun_gloo_with_hosts_is_no_longer_refused():
    from hvd_magic.runner.cli import build_parser, to_launch_args
    from hvd_magic.runner.gloo_run import check
    p = build_parser()
    args = to_launch_args(p.parse_args(["--gloo", "-np", "2", "-H", "a:1,b:1", "python",
                                        "x.py"]), p)
    check(args)                       # no ValueError
    assert [h.name for h in args.hosts] == ["a", "b"]


# ------------------------------------------------------------------ real runs on two hosts
@pytest.fixture
def _torch():
    pytest.importorskip("torch")


def _hvdrun_gloo(hosts, *argv: str, timeout: float = 120):
    return hosts.run([PY, "-m", "hvd_magic.runner.cli", "--gloo", *argv],
                     env=hosts.env(OMP_NUM_THREADS="1", HVD_MAGIC_TORCH_INIT_TIMEOUT="60"),
                     timeout=timeout)


@pytest.mark.slow
@pytest.mark.multihost
def test_readme_example_across_two_hosts_equals_mpi(two_hosts, _torch):
    """`hvdrun --gloo -np 2 -H A:1,B:1` trains the README's example to the weights of
    `hvdrun -np 2` (MPI, one host), bit for bit; rank 1 ran on B (reached through the
    agent), rank 0 on A (hvdrun's own host, started directly), and nothing is left
    running."""
    from mpi_harness import mpi_env, run_job
    script = str(HERE / "mpi" / "readme_example.py")
    open(two_hosts.agent_log, "w").close()          # agent_calls(): this test's only
    proc = _hvdrun_gloo(two_hosts, "--verbose", "-np", "2", "-H", two_hosts.hosts_arg,
                        "--network-interface", "hvd0", PY, script, timeout=150)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert proc.returncode == 0, why
    assert "rank 0: loss" in proc.stdout and "rank 1: loss" in proc.stdout, why
    assert "hvdrun-gloo-exit" not in proc.stdout, why
    assert f"{two_hosts.a.ip}: rank 0, {two_hosts.b.ip}: rank 1" in proc.stderr, why
    assert f"rendezvous {two_hosts.a.ip}:" in proc.stderr and "kept by hvdrun" in proc.stderr
    # B through the agent; A, this machine's address, directly
    assert f"agent {two_hosts.b.ip} " in two_hosts.agent_calls()
    assert f"agent {two_hosts.a.ip} " not in two_hosts.agent_calls(), two_hosts.agent_calls()
    gloo = re.search(r"weights (\[.*\])", proc.stdout).group(1)
    ref = run_job([str(Path(PY).with_name("hvdrun")), "-np", "2", PY, script], mpi_env(), 150,
                  "hvdrun -np 2")
    assert ref.returncode == 0, ref.stderr
    assert re.search(r"weights (\[.*\])", ref.stdout).group(1) == gloo
    assert not two_hosts.leftovers(wait=3.0)


@pytest.mark.slow
@pytest.mark.multihost
def test_a_rank_killed_on_host_b_ends_the_job_naming_it(two_hosts, _torch, tmp_path):
    """Rank 1 (on B, from a --hostfile) is killed by SIGKILL while rank 0 (on A) waits:
    hvdrun names rank 1 and host B, stops rank 0 and exits 128+9; no process is left on
    either host."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{two_hosts.a.ip} slots=1\n{two_hosts.b.ip} slots=1\n")
    code = ("import os, signal, time, torch, hvd_magic.torch as hvd\n"
            "hvd.init()\n"
            "hvd.allreduce(torch.ones(1), name='x')\n"
            "print(f'rank {hvd.rank()} on', os.uname().nodename, flush=True)\n"
            "if hvd.rank() == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(300)\n")
    proc = _hvdrun_gloo(two_hosts, "-np", "2", "--hostfile", str(hostfile),
                        "--network-interface", "hvd0", PY, "-c", code, timeout=150)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert f"rank 1 on {two_hosts.b.ns}" in proc.stdout, why
    assert proc.returncode == 137, why
    assert f"hvdrun: rank 1 on {two_hosts.b.ip} was killed by signal 9; stopping the other " \
           "ranks" in proc.stderr, why
    assert not two_hosts.leftovers(wait=3.0)


@pytest.mark.slow
@pytest.mark.multihost
def test_a_host_the_agent_cannot_reach_ends_the_job_naming_it(two_hosts, _torch):
    """The agent cannot reach the second host: that rank is named as lost, with the
    agent's status and what to check, and rank 0 (waiting for it at the rendezvous on A)
    is stopped."""
    nowhere = two_hosts.b.ip.rsplit(".", 1)[0] + ".9"
    proc = _hvdrun_gloo(two_hosts, "-np", "2", "-H", f"{two_hosts.a.ip}:1,{nowhere}:1",
                        "--network-interface", "hvd0", PY, "-c",
                        "import hvd_magic.torch as hvd; hvd.init()", timeout=150)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert proc.returncode == 255, why
    assert f"hvdrun: rank 1 on {nowhere} was lost: its connection ended before it reported " \
           "an exit status (the agent exited with status 255); check that the host is up and " \
           "that the ssh agent reaches it; stopping the other ranks" in proc.stderr, why
    assert not two_hosts.leftovers(wait=3.0)


@pytest.mark.slow
@pytest.mark.multihost
def test_uneven_hosts_give_horovods_local_and_cross_ranks(two_hosts, _torch):
    """-np 3 -H A:2,B:1: ranks 0-1 on A, 2 on B; hvd.local_rank()/local_size() from the
    placement, hvd.cross_rank()/cross_size() Horovod's (among the ranks with the same local
    rank: rank 1, alone with local rank 1, has cross size 1)."""
    import json
    proc = _hvdrun_gloo(two_hosts, "-np", "3", "-H", f"{two_hosts.a.ip}:2,{two_hosts.b.ip}:1",
                        "--network-interface", "hvd0", PY, "-c",
                        "import json, os, torch, hvd_magic.torch as hvd\n"
                        "hvd.init()\n"
                        "s = hvd.allreduce(torch.ones(1), op=hvd.Sum, name='s').item()\n"
                        "print('PROBE ' + json.dumps([hvd.rank(), os.uname().nodename, "
                        "hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), "
                        "s]), flush=True)\n", timeout=150)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert proc.returncode == 0, why
    got = sorted(json.loads(line[6:]) for line in proc.stdout.splitlines()
                 if line.startswith("PROBE "))
    a, b = two_hosts.a.ns, two_hosts.b.ns
    assert got == [[0, a, 0, 2, 0, 2, 3.0], [1, a, 1, 2, 0, 1, 3.0], [2, b, 0, 1, 1, 2, 3.0]], why
    assert not two_hosts.leftovers(wait=3.0)


@pytest.mark.slow
@pytest.mark.multihost
def test_when_the_first_host_is_another_machine_rank_0_keeps_the_store_there(two_hosts, _torch):
    """hvdrun on A with -H B:1,A:1: rank 0 runs on B, the ranks meet at B's address and
    rank 0 keeps the rendezvous store; the job still runs to the end."""
    proc = _hvdrun_gloo(two_hosts, "--verbose", "-np", "2", "-H",
                        f"{two_hosts.b.ip}:1,{two_hosts.a.ip}:1", "--network-interface", "hvd0",
                        PY, str(HERE / "mpi" / "controller_probe.py"), timeout=150)
    why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nagent:\n{two_hosts.agent_calls()}"
    assert proc.returncode == 0, why
    assert f"on {two_hosts.b.ip}: rank 0, {two_hosts.a.ip}: rank 1 (rendezvous " \
           f"{two_hosts.b.ip}:" in proc.stderr and "kept by rank 0" in proc.stderr, why
    for r in (0, 1):
        assert f"probe rank={r} size=2 local=0/1 cross={r}/2 controller=gloo " \
               "mpi_initialized=False sum=3" in proc.stdout, why
    assert not two_hosts.leftovers(wait=3.0)


# ------------------------------------------------------------------------------- real ssh
@contextlib.contextmanager
def _sshd_on(hosts, host):
    """A real OpenSSH server on ``host``'s address, in its namespace under its hostname,
    taking only a key made here; yields the ssh command line (the agent) that reaches it and
    the server's pid."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        pytest.skip("no OpenSSH server (make setup installs openssh-server)")
    d = os.path.join(hosts.shared, "ssh")
    os.makedirs(d, mode=0o700, exist_ok=True)
    key, host_key = os.path.join(d, "id_ed25519"), os.path.join(d, "host_ed25519")
    for k in (key, host_key):
        if not os.path.exists(k):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k], check=True)
    shutil.copy(key + ".pub", os.path.join(d, "authorized_keys"))
    config = os.path.join(d, "sshd_config")
    with open(config, "w") as fh:
        fh.write(f"ListenAddress {host.ip}\nPort 22\nHostKey {host_key}\n"
                 f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                 "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                 f"StrictModes no\nPidFile {d}/sshd.pid\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)       # its privilege separation
    log = open(os.path.join(d, "sshd.log"), "w")
    proc = subprocess.Popen(["ip", "netns", "exec", host.ns, "unshare", "-u", "sh", "-c",
                             'hostname "$0" && exec "$1" -D -e -f "$2"', host.ns, sshd, config],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while "Server listening" not in Path(log.name).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                Path(log.name).read_text()
            time.sleep(0.05)
        yield (f"ssh -i {key} -o BatchMode=yes -o StrictHostKeyChecking=no "
               "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"), proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        log.close()


@pytest.mark.slow
@pytest.mark.multihost
def test_readme_example_over_real_ssh_to_host_b(two_hosts, _torch):
    """Host B reached through a real OpenSSH server and client (its login environment,
    its quoting of the command line): `hvdrun --gloo -np 2 -H A:1,B:1` trains the README's
    example on both hosts; rank 1 ran on B, under B's hostname; nothing is left there."""
    script = str(HERE / "mpi" / "readme_example.py")
    code = ("import socket\nimport runpy\n"
            "print('host of rank', __import__('os').environ['RANK'], socket.gethostname(),"
            " flush=True)\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")
    with _sshd_on(two_hosts, two_hosts.b) as (agent, sshd):
        proc = two_hosts.run([PY, "-m", "hvd_magic.runner.cli", "--gloo", "-np", "2", "-H",
                              two_hosts.hosts_arg, "--network-interface", "hvd0", PY, "-c", code],
                             env=two_hosts.env(OMP_NUM_THREADS="1", PRTE_MCA_plm_ssh_agent=agent,
                                               HVD_MAGIC_TORCH_INIT_TIMEOUT="60"),
                             timeout=150)
        why = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        assert proc.returncode == 0, why
        assert f"host of rank 1 {two_hosts.b.ns}" in proc.stdout, why
        assert "rank 0: loss" in proc.stdout and "rank 1: loss" in proc.stdout, why
        assert "hvdrun-gloo-exit" not in proc.stdout, why
        assert not two_hosts.leftovers(wait=3.0, ignore=[sshd]), why
    with open(os.path.join(two_hosts.shared, "ssh", "sshd.log")) as fh:
        sshd_log = fh.read()
    # the rank on B came in over ssh, from host A
    assert f"Accepted publickey for root from {two_hosts.a.ip}" in sshd_log, sshd_log


def test_torchrun_across_two_namespace_hosts(two_hosts, _torch):
    """`torchrun --nnodes 2 --rdzv-endpoint HOST_A:PORT` on two hosts (network namespaces
    joined by a veth pair, tests/netns_hosts.py), one rank each: one world of 2 with the
    node as cross rank, and torch_checks.py's DistributedOptimizer equivalence passes."""
    from mpi_harness import TORCHRUN, probes, torch_env

    def start(host, node: int, script: str):
        argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                "--rdzv-backend", "c10d", "--rdzv-id", "hvdtest",
                "--rdzv-endpoint", f"{two_hosts.a.ip}:29411", "--local-addr", host.ip,
                # (which node keeps the store: said, as the hosts' names do not resolve)
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                "--max-restarts", "0", str(HERE / "mpi" / script)]
        env = torch_env({"GLOO_SOCKET_IFNAME": "hvd0"})
        return subprocess.Popen(two_hosts.wrap(argv, host), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                stdin=subprocess.DEVNULL)

    for script in ("controller_probe.py", "torch_checks.py"):
        procs = [start(two_hosts.a, 0, script), start(two_hosts.b, 1, script)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=240))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError(f"{script} across two hosts hung: "
                                     f"{[q.communicate(timeout=10) for q in procs]}") from None
        out = "".join(o for o, _ in outs)
        assert all(p.returncode == 0 for p in procs), (script, outs)
        if script == "controller_probe.py":
            got = probes(out)
            assert sorted(got) == [0, 1], out
            for r, f in got.items():
                assert f["size"] == "2" and f["sum"] == "3" and f["controller"] == "gloo", f
                assert f["local"] == "0/1" and f["cross"] == f"{r}/2", f
        else:
            assert "[rank 0] done, 0 failures" in out and "[rank 1] done, 0 failures" in out, outs
