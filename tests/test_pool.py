"""The pool: planning (pure, no processes) and a real pool's sockets, files and clean end."""
from __future__ import annotations

import json
import os
import stat
import time
import uuid

import pytest

from hvd_magic.kernel import PoolConfig, PoolManager, TextSink, plan_pool
from hvd_magic.kernel.ranks.engine import gpu_for_local_rank, local_rank_from_env
from hvd_magic.kernel.notebook.output import PoolCellError, RankFailure, group_failures
from hvd_magic.kernel.notebook.procs import parse_rank_exits
from hvd_magic.runner.plan import Host

psutil = pytest.importorskip("psutil")

MARKERS = ("hvd_magic.kernel.ranks.engine", "hvd_magic.kernel.controller", "ipyparallel.engine.nanny")

#: Every process these tests start inherits this variable, so the orphan checks see only
#: their own pools, not those of notebooks running beside them on the same machine.
TAG = os.environ.setdefault("HVD_MAGIC_TEST_TAG", uuid.uuid4().hex)


def pool_processes() -> list:
    """Every process of a pool these tests started (mpiexec/prterun included)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(p.info["cmdline"] or [])
            if (p.info["status"] != psutil.STATUS_ZOMBIE and any(m in line for m in MARKERS)
                    and p.environ().get("HVD_MAGIC_TEST_TAG") == TAG):
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait_no_pool_processes(timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = pool_processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def config(**kw) -> PoolConfig:
    base = dict(np=2, workdir="/tmp/hvdm-test", key="k" * 32, mpiexec="/x/mpiexec",
                python="/x/python", environ={"PATH": "/usr/bin"})
    base.update(kw)
    return PoolConfig(**base)


# ---------------------------------------------------------------- planning (pure)

def test_single_host_plan_uses_ipc_namespace_and_no_nanny():
    plan = plan_pool(config(netns=True))
    assert plan.single_host
    assert plan.engine_argv[:4] == ["/x/python", "-m", "hvd_magic.runner.netns", "--"]
    assert "--IPEngine.enable_nanny=False" in plan.engine_argv
    assert plan.engine_info["interface"] == "ipc:///tmp/hvdm-test/s"
    assert plan.client_info["interface"] == "ipc:///tmp/hvdm-test/s"
    assert "--IPController.transport=ipc" in plan.controller_argv
    assert "--HeartMonitor.period=100" in plan.controller_argv
    assert "--HeartMonitor.max_heartmonitor_misses=30" in plan.controller_argv
    env = plan.engine_env
    assert env["OMPI_MCA_btl"] == "self,sm"
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    assert json.loads(env["IPP_CONNECTION_INFO"])["key"] == "k" * 32
    assert "IPP_CONNECTION_INFO" in plan.engine_argv      # forwarded by name, not value
    assert env["PATH"].startswith("/x")                    # the venv's bin first
    assert any("namespace" in n for n in plan.notes)


def test_without_namespace_the_notes_say_mpiexec_listens_everywhere():
    plan = plan_pool(config(netns=False))
    assert "hvd_magic.runner.netns" not in plan.engine_argv
    assert any("0.0.0.0" in n for n in plan.notes)


def test_multi_host_plan_listens_on_the_reachable_address_only():
    hosts = [Host("node1", 2), Host("node2", 2)]
    plan = plan_pool(config(np=4, hosts=hosts, controller_ip="10.0.0.5",
                            ports=list(range(5000, 5016)),
                            environ={"PATH": "/usr/bin", "PYTHONPATH": "/code"}))
    assert not plan.single_host
    assert plan.engine_info["interface"] == "tcp://10.0.0.5"
    assert plan.client_info["interface"].startswith("ipc://")
    argv = plan.engine_argv
    assert argv[argv.index("-H") + 1] == "node1:2,node2:2"
    assert "hvd_magic.runner.netns" not in argv
    assert "--IPEngine.enable_nanny=False" not in argv        # interrupts go via nannies
    assert "--IPController.engine_ip=10.0.0.5" in plan.controller_argv
    for name in ("PATH", "PYTHONPATH", "IPP_CONNECTION_INFO"):
        assert argv[argv.index(name) - 1] == "-x"
    assert "0.0.0.0" not in " ".join(plan.controller_argv)


def test_controller_ports_are_free_and_outside_the_range_the_os_hands_out(tmp_path,
                                                                          monkeypatch):
    import socket
    from hvd_magic.kernel.notebook import ports
    assert ports.candidates(32768, 60999) == range(22768, 32768)
    assert ports.candidates(1024, 60999) == range(61000, 65536)   # nothing below: above
    assert ports.candidates(20000, 65535) == range(10000, 20000)
    bad = tmp_path / "range"
    bad.write_text("garbage")
    assert ports.os_range(str(bad)) == (32768, 60999)
    lo, hi = ports.os_range()
    chosen = ports.controller_ports(16)
    assert len(set(chosen)) == 16 and not any(lo <= p <= hi for p in chosen), chosen
    monkeypatch.setattr(ports, "candidates", lambda lo, hi: chosen[:3])
    with socket.socket() as s:                     # one of three taken: the other two
        s.bind(("", chosen[0]))
        s.listen()
        assert sorted(ports.controller_ports(2)) == sorted(chosen[1:3])
        with pytest.raises(RuntimeError, match="no 3 free TCP ports"):
            ports.controller_ports(3)


def test_hostfile_is_passed_to_mpiexec():
    plan = plan_pool(config(np=2, hostfile="/h/hosts", hosts=[Host("n1", 2)],
                            controller_ip="10.0.0.5", ports=list(range(5000, 5016))))
    assert plan.engine_argv[plan.engine_argv.index("--hostfile") + 1] == "/h/hosts"


@pytest.mark.parametrize("np, hosts, err", [
    (0, None, ValueError), (-1, None, ValueError), ("2", None, TypeError),
    (True, None, TypeError), (5, [Host("n1", 2), Host("n2", 2)], ValueError),
    (3, [Host("localhost", 2)], ValueError),
])
def test_bad_sizes_are_refused_with_what_to_do(np, hosts, err):
    with pytest.raises(err) as info:
        plan_pool(config(np=np, hosts=hosts, controller_ip="10.0.0.5",
                         ports=list(range(5000, 5016))))
    assert "-np" in str(info.value)


def test_oversubscription_can_be_allowed():
    plan = plan_pool(config(np=3, hosts=[Host("localhost", 2)], oversubscribe=True))
    assert plan.engine_env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    # several hosts: by slot, or Open MPI puts every rank on the first host
    plan = plan_pool(config(np=3, hosts=[Host("n1", 1), Host("n2", 1)], oversubscribe=True,
                            controller_ip="10.0.0.5", ports=list(range(5000, 5016))))
    assert plan.engine_env["PRTE_MCA_rmaps_default_mapping_policy"] == "slot:oversubscribe"


def test_too_long_socket_directory_is_refused():
    with pytest.raises(ValueError, match="TMPDIR"):
        plan_pool(config(workdir="/tmp/" + "x" * 120))


def test_gpu_pinning_by_local_rank():
    assert gpu_for_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 4) == "1"
    assert gpu_for_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 4) == "1"
    assert gpu_for_local_rank({"MPI_LOCALRANKID": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 0) == "3"
    assert gpu_for_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 0) is None      # no GPU
    assert gpu_for_local_rank({}, 4) is None
    assert gpu_for_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "HVD_MAGIC_PIN_GPU": "0"},
                              4) is None
    assert local_rank_from_env({"PMI_LOCAL_RANK": "3"}) == 3


def test_rank_exits_from_open_mpi_messages():
    log = ("prterun noticed that process rank 1 with PID 14080 on node vm exited on\n"
           "signal 9 (Killed).\n ... Process name: [prterun-vm-14129@1,0]\n"
           "   Exit code:    3\n")
    exits = parse_rank_exits(log)
    assert [(e.rank, e.how) for e in exits] == [(0, "exited with code 3"),
                                                (1, "killed by signal 9 (Killed) on vm")]


def test_identical_tracebacks_are_grouped():
    fails = [RankFailure(0, "error", "ValueError", "x", ["tb A"]),
             RankFailure(1, "error", "ValueError", "x", ["\x1b[31mtb A\x1b[0m"]),
             RankFailure(2, "error", "KeyError", "y", ["tb B"])]
    groups = group_failures(fails)
    assert [g[0] for g in groups] == [[0, 1], [2]]
    text = "\n".join(PoolCellError(fails)._render_traceback_())
    assert text.count("tb A") == 1 and "ranks 0, 1" in text and "rank 2" in text


def test_text_sink_prefixes_whole_lines(capsys):
    sink = TextSink()
    sink.stream(1, "stdout", "a\nb")
    sink.stream(0, "stdout", "x\n")
    sink.stream(1, "stdout", "c\n")
    sink.result(0, {"text/plain": "1\n2"})
    sink.close()
    assert capsys.readouterr().out == "[1] a\n[0] x\n[1] bc\n[0] Out: 1\n         2\n"


# ---------------------------------------------------------------- a real pool

@pytest.fixture(scope="module")
def manager():
    m = PoolManager()
    yield m
    m.stop()


def test_pool_sockets_files_and_clean_stop(manager, capsys):
    pool = manager.ensure(2, None, None, TextSink())
    mine = {p.pid for p in pool.known} | {pool.mpiexec.pid, pool.controller.pid}
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in mine]
    assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening
    for path in (pool.plan.engine_file, pool.plan.client_file):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pool.config.workdir).st_mode) == 0o700
    assert sorted(pool.pids) == [0, 1]
    # the ranks run in this (the kernel's) session, so the scheduler weighs them with the
    # kernel's threads and the live panel's low-priority redraw yields to them; in process
    # groups of their own, so an interrupt sent to the kernel's group does not reach them
    for pid in [pool.mpiexec.pid, pool.controller.pid, *pool.pids.values()]:
        assert os.getsid(pid) == os.getsid(0) and os.getpgid(pid) != os.getpgid(0), pid
    out = pool.run_cell("import hvd_magic.collectives as hvd\nhvd.rank(), hvd.size()", TextSink())
    assert out.results[1]["text/plain"] == "(1, 2)"
    workdir = pool.config.workdir
    t0 = time.monotonic()
    assert manager.stop()
    assert time.monotonic() - t0 < 5
    assert not wait_no_pool_processes(1.0)
    assert not os.path.exists(workdir)


def test_stop_lets_each_rank_end_as_a_script_does(tmp_path):
    """`%hvd stop` (the pool's stop): every rank's atexit handlers run and a file a cell
    left open is flushed, as at the end of a script under hvdrun; the ranks end cleanly."""
    m = PoolManager()
    try:
        pool = m.ensure(2, None, None, TextSink())
        pool.run_cell(f"""import atexit, hvd_magic.collectives as hvd
r = hvd.rank()
atexit.register(lambda: open("{tmp_path}/atexit-%d" % r, "w").write("saved %d" % r))
log = open("{tmp_path}/log-%d" % r, "w")
log.write("step 1 of rank %d" % r)""", TextSink())
        mpiexec = pool.mpiexec
        t0 = time.monotonic()
        assert m.stop()
        took = time.monotonic() - t0
    finally:
        m.stop()
    for r in (0, 1):
        assert (tmp_path / f"atexit-{r}").read_text() == f"saved {r}"
        assert (tmp_path / f"log-{r}").read_text() == f"step 1 of rank {r}"
    assert mpiexec.returncode == 0, mpiexec.returncode       # no rank failed on its way out
    assert took < 10, took                                      # a hang guard only
    assert not wait_no_pool_processes(1.0)


def test_without_a_namespace_the_pool_says_so_and_keeps_its_own_sockets_local(monkeypatch,
                                                                               capsys):
    monkeypatch.setenv("HVD_MAGIC_NETNS", "0")
    m = PoolManager()
    try:
        pool = m.ensure(2, None, None, TextSink())
        assert "hvd_magic.runner.netns" not in pool.plan.engine_argv
        assert "no loopback-only network namespace" in capsys.readouterr().err
        ours = {p.pid for p in pool.known if p.pid != pool.mpiexec.pid}   # prterun aside
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in ours]
        assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening
        assert pool.run_cell("1", TextSink()).results[0]["text/plain"] == "1"
    finally:
        m.stop()
    assert not wait_no_pool_processes(2.0)


def test_stale_pool_directories_are_cleaned(tmp_path):
    from hvd_magic.kernel.notebook.cells import clean_stale_dirs
    old, new = tmp_path / "hvdm-old", tmp_path / "hvdm-new"
    old.mkdir()
    new.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert clean_stale_dirs(str(tmp_path)) == [str(old)]
    assert new.exists() and not old.exists()


def test_a_paused_rank_keeps_the_pool_until_the_heartbeat_limit():
    """A rank that stops answering the controller's heartbeat for a moment (here: SIGSTOP,
    as a loaded machine or a debugger would) must not lose a healthy pool, and a rank silent
    past the limit (3 s) ends the pool with an error naming that rank and why."""
    import signal
    import threading
    from hvd_magic.kernel.notebook.output import RankDiedError
    m = PoolManager()
    try:
        pool = m.ensure(2, None, None, TextSink())
        pid = pool.pids[1]

        def pause(seconds: float) -> None:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, lambda: psutil.pid_exists(pid) and os.kill(
                pid, signal.SIGCONT)).start()

        pause(1.5)
        out = pool.run_cell("import hvd_magic.collectives as hvd\nhvd.rank()", TextSink())
        assert out.results[1]["text/plain"] == "1"
        assert pool.alive()
        pause(6.0)
        with pytest.raises(RankDiedError) as info:
            pool.run_cell("import time\ntime.sleep(8)", TextSink())
        text = str(info.value)
        assert "rank 1" in text and "heartbeat" in text, text
        assert "MPI job ended" not in text, text
    finally:
        m.stop()
    assert not wait_no_pool_processes(3.0)


def test_the_one_private_ipyparallel_attribute_the_pool_reads():
    """Pool reads each rank's future through ``rank_futures`` (ipyparallel's private
    ``AsyncResult._children``: there is no public per-engine future); pinned here."""
    from hvd_magic.kernel.notebook.cells import rank_futures
    m = PoolManager()
    try:
        pool = m.ensure(2, None, None, None)
        ar = pool.client[[0, 1]].execute("1", block=False)
        futs = rank_futures(ar)
        assert len(futs) == 2 and all(hasattr(f, "iopub_callbacks") for f in futs)
        ar.wait(10)
        assert all(f.done() and f.exception() is None for f in futs)
        assert len(ar.metadata) == 2          # public: one dict per rank
    finally:
        m.stop()
