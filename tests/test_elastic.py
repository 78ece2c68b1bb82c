"""hvd.elastic.run surviving a lost rank, for real: scripts under `hvdrun --min-np` (torch:
tests/mpi/elastic_torch.py; Keras: tests/mpi/elastic_keras.py) and a `--min-np` pool, one rank
SIGKILLed mid-training."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_harness import mpi_env, run_job

HERE = Path(__file__).parent
HVDRUN = str(Path(sys.executable).with_name("hvdrun"))


def hvdrun(np_, min_np, *args, timeout=120):
    cmd = [HVDRUN, "-np", str(np_), *(["--min-np", str(min_np)] if min_np else []),
           sys.executable, str(HERE / "mpi" / "elastic_torch.py"), *args]
    return run_job(cmd, mpi_env(), timeout, "hvdrun")


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
    proc = run_job(cmd, mpi_env(), 240, "hvdrun (Keras)")
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic keras OK") == 2, out
    assert "elastic: lost rank(s) 2; continuing on 2 rank(s) from commit" in out
    kill = float(re.search(r"KILL (\S+)", out).group(1))
    assert float(re.search(r"RESUMED (\S+)", out).group(1)) - kill <= 10.0, out


POOL_CELL = '''
import os, signal, time, torch
import hvd_magic
import hvd_magic.torch as hvd
world = hvd.size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)

@hvd.elastic.run
def train(state):
    while state.step < 20:
        if state.step == 7 and hvd.rank() == world - 1 and hvd.size() == world:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.ones(2, 4) * (hvd.rank() + 1)).sum().backward()
        opt.step()
        state.step += 1
        hvd_magic.report(samples=2)
        if hvd.size() < world:
            time.sleep(0.1)           # the panel's batches see the ranks after the reset
        if state.step % 3 == 0:
            state.commit()

train(state)
hvd.rank(), hvd.size(), state.step
'''


def test_an_elastic_pool_finishes_the_cell_on_the_survivors_and_keeps_them():
    from hvd_magic.kernel import PoolManager, TextSink
    from hvd_magic.widgets.text import TelemetryTextSink

    class Sink(TelemetryTextSink):           # the live panel's model, in text
        def __init__(self):
            super().__init__(ranks=[0, 1, 2])
            self.lines = []
            self.live_lost = False

        def status(self, text):
            self.lines.append(text)

        def ingest(self, batches):
            super().ingest(batches)
            if self.cell.resets and self.cell.rank[2].status == "lost":
                self.live_lost = self.live_lost or not self.cell.finished

    manager = PoolManager()
    try:
        pool = manager.ensure(3, None, None, TextSink(), min_np=2)
        sink = Sink()
        t0 = time.monotonic()
        out = pool.run_cell(POOL_CELL, sink)
        took = time.monotonic() - t0
        assert [out.results[r]["text/plain"] for r in (0, 1)] == ["(0, 2, 20)", "(1, 2, 20)"]
        assert any("rank 2" in s and "the pool goes on with 2 ranks, renumbered 0..1" in s
                   for s in sink.lines), sink.lines
        assert pool.size == 2 and pool.alive() and took < 30
        assert sink.cell.rank[2].status == "lost" and sink.cell.live_ranks() == [0, 1]
        assert any("rank 2 lost (the others went on)" in s for s in sink.lines), sink.lines
        # the ranks' telemetry told the panel while the cell ran: the lost rank, the reset
        # (drawn on the timeline) and throughput counted again from the resume on 2 ranks
        assert sink.live_lost
        (reset,) = list(sink.cell.resets)
        assert reset.lost == [2] and reset.size == 2 and reset.commit == 2 and reset.t1 > reset.t0
        summary = "\n".join(sink.lines)
        assert re.search(r"elastic reset at [\d.]+ s: rank 2 lost; 2 ranks went on from commit "
                         r"2 \([\d.]+ s\)", summary), summary
        assert "samples/s in total since the last reset" in summary, summary
        assert sink.cell.tput[0].first[0] >= reset.t1
        spans = sink.cell.track.all_spans()           # the timeline goes on after the reset
        assert all(max(e for _s, e, _p, _l in spans[r]) > reset.t1 * 1e6 for r in (0, 1))
        # later cells and %hvd pull see the survivors, renumbered
        assert pool.pull("world", ranks=[1]) == [3]
        again = pool.run_cell("hvd.rank(), hvd.size(), float(model.weight.sum())", TextSink())
        w0, w1 = (again.results[r]["text/plain"] for r in (0, 1))
        assert w0.startswith("(0, 2, ") and w1.startswith("(1, 2, ") and w0[7:] == w1[7:]
        # the same request reuses the elastic pool at its new size
        assert manager.ensure(3, None, None, TextSink(), min_np=2) is pool
    finally:
        manager.stop()


def test_a_rank_whose_training_raises_leaves_an_elastic_pool_and_the_others_go_on():
    """Horovod treats a worker's exception as that worker's failure: in a notebook pool the
    other ranks finish the cell from the last commit, the failed rank's engine leaves, and
    the pool goes on with the others, the failure named."""
    from hvd_magic.kernel import PoolManager, TextSink
    cell = POOL_CELL.replace("os.kill(os.getpid(), signal.SIGKILL)",
                             "raise ValueError('bad batch')")

    class Sink(TextSink):
        def __init__(self):
            super().__init__()
            self.lines = []

        def status(self, text):
            self.lines.append(text)

    manager = PoolManager()
    try:
        pool = manager.ensure(3, None, None, TextSink(), min_np=2)
        sink = Sink()
        out = pool.run_cell(cell, sink)
        assert [out.results[r]["text/plain"] for r in (0, 1)] == ["(0, 2, 20)", "(1, 2, 20)"]
        assert any(s == "hvd: rank 2 failed (ValueError: bad batch) and left the job; the pool "
                   "goes on with 2 ranks, renumbered 0..1" for s in sink.lines), sink.lines
        assert pool.size == 2 and pool.alive()
        again = pool.run_cell("hvd.rank(), hvd.size()", TextSink())
        assert [again.results[r]["text/plain"] for r in (0, 1)] == ["(0, 2)", "(1, 2)"]
    finally:
        manager.stop()


def test_an_elastic_pool_ends_as_before_when_the_cell_does_not_use_elastic_run():
    from hvd_magic.kernel import PoolManager, RankDiedError, TextSink
    manager = PoolManager()
    try:
        pool = manager.ensure(2, None, None, TextSink(), min_np=1)
        with pytest.raises(RankDiedError) as info:
            pool.run_cell("import os, signal, numpy as np\nimport hvd_magic.collectives as hvd\n"
                          "if hvd.rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                          "hvd.allreduce(np.ones(3))", TextSink())
        assert "rank 1" in str(info.value) and not pool.alive()
    finally:
        manager.stop()


def test_a_paused_rank_in_an_elastic_pool_still_ends_the_cell_naming_it():
    # SIGSTOP is no failure to MPI: the others would wait for the rank forever; the pool
    # tells a paused rank (its process is there) from a dead one and ends as for any pool
    from hvd_magic.kernel import PoolManager, RankDiedError, TextSink
    manager = PoolManager()
    try:
        pool = manager.ensure(3, None, None, TextSink(), min_np=2)
        cell = POOL_CELL.replace("signal.SIGKILL", "signal.SIGSTOP")
        t0 = time.monotonic()
        with pytest.raises(RankDiedError) as info:
            pool.run_cell(cell, TextSink(), timeout=60)
        assert "rank 2" in str(info.value) and time.monotonic() - t0 < 30
        assert not pool.alive()
    finally:
        manager.stop()


def test_the_job_grows_and_shrinks_at_commits_as_the_discovery_script_says(tmp_path):
    # 2 ranks -> 3 (a spawned rank gets the committed state before its first step) -> 2
    slots = tmp_path / "slots"
    slots.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {slots}\n")
    script.chmod(0o755)
    cmd = [HVDRUN, "-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script",
           str(script), sys.executable, str(HERE / "mpi" / "elastic_grow.py"), str(slots)]
    proc = run_job(cmd, mpi_env(), 120, "hvdrun")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.count("elastic OK") == 2 and "JOINED as rank 2" in out, out
    assert "hosts updated, 1 rank(s) joined; continuing on 3 rank(s) from commit 3" in out
    assert "rank 2 leaves the job (hosts updated: 2 rank(s) now)" in out
    assert "hosts updated, 1 rank(s) left; continuing on 2 rank(s) from commit 8" in out


def test_a_discovery_script_that_is_not_executable_is_refused_before_the_start(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("echo localhost:3\n")
    proc = subprocess.run([HVDRUN, "-np", "2", "--min-np", "1", "--host-discovery-script",
                           str(script), sys.executable, "-c", "pass"],
                          env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "not an executable file (chmod +x it" in proc.stderr


def test_discovery_output_and_the_size_it_asks_for():
    from hvd_magic.collectives.elastic import parse_discovery, target_size
    assert parse_discovery("a:2\nb\n\n# comment\na:1\n") == {"a": 3, "b": 1}
    with pytest.raises(ValueError, match="line 2: 'b:x' is not 'host' or 'host:slots'"):
        parse_discovery("a:2\nb:x\n")
    assert target_size(2, slots=3, min_np=1, max_np=None) == 3
    assert target_size(2, slots=8, min_np=1, max_np=4) == 4
    assert target_size(3, slots=1, min_np=2, max_np=4) == 3      # too few slots: stay


def test_hvdrun_plans_tcp_on_loopback_for_ranks_that_join_later(tmp_path):
    from hvd_magic.runner.plan import LaunchArgs, plan_launch
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:3\n")
    script.chmod(0o755)
    args = LaunchArgs(np=2, command=["python", "t.py"], min_np=1, max_np=3,
                      host_discovery_script=str(script))
    argv, env = plan_launch(args, {"OMPI_MCA_btl": "self,sm"}, "openmpi")
    assert argv[:5] == ["mpiexec", "-n", "2", "--with-ft", "ulfm"]
    assert env["OMPI_MCA_btl"] == "self,sm,tcp" and env["OMPI_MCA_btl_tcp_if_include"] == "lo"
    assert env["HVD_MAGIC_ELASTIC_MAX_NP"] == "3"
    with pytest.raises(ValueError, match="give --min-np too"):
        plan_launch(LaunchArgs(np=2, command=["x"], max_np=3), {}, "openmpi")


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_a_rank_whose_training_raises_leaves_and_the_others_finish(np_):
    # Horovod: a worker's exception is that worker's failure; the others restore the last
    # commit and go on, and the launcher ends with their result
    proc = hvdrun(np_, 1, "0:5:1:raise")
    out = proc.stdout + proc.stderr
    assert proc.stdout.count("elastic OK") == np_ - 1 and "FAIL" not in out, out
    assert re.search(rf"elastic: rank 1 failed: ValueError: bad batch; continuing on {np_ - 1} "
                     r"rank\(s\) from commit \d+", out), out
    assert 'raise ValueError("bad batch")' in proc.stderr, out     # its traceback
    assert f"rank 1 failed (ValueError: bad batch) and leaves the job; {np_ - 1} rank(s) go on" \
        in out, out
    assert proc.returncode == 0, out


def test_a_raising_rank_that_leaves_fewer_than_min_np_is_an_error_that_says_so():
    proc = hvdrun(2, 2, "0:5:1:raise")
    out = proc.stdout + proc.stderr
    assert "elastic OK" not in out and proc.returncode != 0, out
    assert ("rank 1 failed (ValueError: bad batch) and 1 rank(s) are left, fewer than the "
            "minimum of 2 (hvdrun --min-np)") in out, out


def test_a_state_attribute_named_like_the_runtime_s_bookkeeping_is_the_user_s():
    # Horovod's ObjectState makes every keyword an attribute; the runtime counted commits in
    # an attribute `commits`, so a user's own `commits` was reset to 0 and counted twice
    from hvd_magic.torch.elastic import ObjectState
    state = ObjectState(lambda obj: obj, lambda: 0, commits=5, generation="g", values=[1])
    assert (state.commits, state.generation, state.values) == (5, "g", [1])
    for _ in range(2):
        state.commits += 1
        state.commit()
    assert state.commits == 7
    state.commits = 100
    state.restore()
    assert state.commits == 7


def test_a_failed_host_stays_out_of_discovery_for_its_cooldown():
    from hvd_magic.collectives.elastic import Blacklist, check_cooldown_range, cooldown_seconds
    # Horovod's driver: MIN * 2**failures + jitter * MIN, within [MIN, MAX]
    assert cooldown_seconds((10, 100), 1, 0.5) == 25
    assert cooldown_seconds((10, 100), 2, 0.0) == 40
    assert cooldown_seconds((10, 100), 4, 0.0) == 100
    with pytest.raises(ValueError, match="1 <= MIN <= MAX <= 3600"):
        check_cooldown_range((0, 10))
    with pytest.raises(ValueError, match="1 <= MIN <= MAX <= 3600"):
        check_cooldown_range((5, 4000))
    hosts = {"a": 2, "b": 2}
    forever = Blacklist()                      # no range: out for the rest of the job
    forever.add("b", now=0)
    assert forever.usable(hosts, now=1e9) == {"a": 2}
    cool = Blacklist((10, 100))
    cool.add("b", now=0, jitter=0.0)           # out for 20 s
    assert cool.usable(hosts, now=19.9) == {"a": 2}
    assert cool.usable(hosts, now=20) == hosts
    cool.add("b", now=15, jitter=0.0)          # a failure within the cooldown adds nothing
    assert cool.usable(hosts, now=20) == hosts
    cool.add("b", now=30, jitter=0.0)          # the second failure: 40 s
    assert cool.usable(hosts, now=69) == {"a": 2} and cool.usable(hosts, now=70) == hosts


def test_hvdrun_passes_the_reset_limit_and_cooldown_to_the_ranks():
    from hvd_magic.runner.cli import build_parser, to_launch_args
    from hvd_magic.runner.plan import plan_launch
    parser = build_parser()
    ns = parser.parse_args(["-np", "2", "--min-np", "1", "--reset-limit", "3",
                            "--blacklist-cooldown-range", "15", "30", "python", "t.py"])
    _argv, env = plan_launch(to_launch_args(ns, parser), {}, "openmpi")
    assert env["HVD_MAGIC_ELASTIC_RESET_LIMIT"] == "3"
    assert env["HVD_MAGIC_BLACKLIST_COOLDOWN_RANGE"] == "15 30"
    for bad in (["--reset-limit", "1"], ["--min-np", "1", "--blacklist-cooldown-range", "0", "5"]):
        with pytest.raises(SystemExit):
            to_launch_args(parser.parse_args(["-np", "2", *bad, "python", "t.py"]), parser)


def test_a_reset_past_the_reset_limit_ends_the_job_saying_so():
    cmd = [HVDRUN, "-np", "3", "--min-np", "1", "--reset-limit", "1", sys.executable,
           str(HERE / "mpi" / "elastic_torch.py"), "0:5:2,1:3:0"]
    proc = run_job(cmd, mpi_env(), 120, "hvdrun")
    out = proc.stdout + proc.stderr
    assert "lost rank(s) 2; continuing on 2 rank(s)" in out, out     # the one reset allowed
    assert proc.returncode != 0 and "elastic OK" not in out, out
    assert "the job has been reset 1 time(s), the most hvdrun --reset-limit 1 allows" in out, out


def test_a_job_whose_launcher_dies_after_every_rank_finished_succeeds_and_says_so():
    # Open MPI's launcher can crash tearing down a job that grew onto an added host
    # (test_multihost's growth test met it once in CI): the ranks, not the launcher, decide
    script = str(HERE / "mpi" / "elastic_launcher_dies.py")
    proc = run_job([HVDRUN, "-np", "2", "--min-np", "1", sys.executable, script], mpi_env(),
                   120, "hvdrun")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.count("SUM 2.0") == 2, out
    assert "mpiexec was ended by signal 9 after all 2 rank(s) had finished; the job " \
           "succeeded" in proc.stderr, out
    assert "[hvd_magic exit]" not in out, out       # hvdrun's own bookkeeping, not shown
    failed = run_job([HVDRUN, "-np", "2", "--min-np", "1", sys.executable, script, "raise"],
                     mpi_env(), 120, "hvdrun")
    assert failed.returncode != 0 and "this rank's training failed" in failed.stderr, \
        failed.stdout + failed.stderr


def test_the_ranks_exit_lines_decide_only_when_the_launcher_was_killed():
    from hvd_magic.runner.plan import elastic_exit
    done = ["[hvd_magic exit] rank=1 size=2 ok=1", "[hvd_magic exit] rank=0 size=2 ok=1"]
    assert elastic_exit(134, done)[0] == 0
    assert elastic_exit(1, done) == (1, None)            # the launcher's own verdict stands
    assert elastic_exit(0, []) == (0, None)
    assert elastic_exit(134, done[:1]) == (134, None)   # rank 0 did not report
    assert elastic_exit(134, done[:1] + ["[hvd_magic exit] rank=0 size=2 ok=0"])[0] == 134
    # a rank that left when the job shrank reported the size it had then
    shrunk = ["[hvd_magic exit] rank=2 size=3 ok=1"] + done
    assert elastic_exit(134, shrunk)[0] == 0


def test_a_collective_failing_on_a_revoked_communicator_is_a_lost_rank():
    """A rank that fails revokes the communicators; on the others the revoke can land in
    negotiation or in the data's allreduce, which MPI reports as MPI_ERR_REVOKED, or as
    MPI_ERR_OTHER from a nonblocking collective. Either is the lost-rank error that
    ``hvd.elastic.run`` starts again from: a plain error there ended the cell on the
    survivors while the failed rank waited for them in Shrink (a hang, about 1 run in 5 of
    the pool test above)."""
    from mpi4py import MPI

    from hvd_magic.collectives.errors import RankLostError, rank_lost_error

    class Revoked:
        def Is_revoked(self):
            return True

    assert isinstance(rank_lost_error(MPI.Exception(MPI.ERR_REVOKED), "rank 0"), RankLostError)
    assert isinstance(rank_lost_error(MPI.Exception(MPI.ERR_OTHER), "rank 0", Revoked()),
                      RankLostError)
    assert rank_lost_error(MPI.Exception(MPI.ERR_OTHER), "rank 0") is None
