"""Every rank's stack: at a stall, on SIGUSR1 to hvdrun, from a rank that holds the GIL in
C code, and in a notebook's pool (%hvd stacks on a busy pool, the stall report in a cell).
Real jobs throughout; the parsing and grouping on known dumps first."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hvd_magic.stacks import group
from mpi_harness import HERE, MPIEXEC, mpi_env, mpirun, run_job

HVDRUN = str(Path(sys.executable).with_name("hvdrun"))
SCRIPT = HERE / "mpi" / "stall_stacks.py"
STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}


def line_of(mark: str) -> int:
    """The line of ``stall_stacks.py`` that holds ``# mark``."""
    for i, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith("# " + mark) or f"# {mark} " in line or line.endswith(f"# {mark}"):
            return i
    raise AssertionError(mark)


# ---------------------------------------------------------------- pure: parse, group, render

def _dump(*threads):
    """A faulthandler dump: ``threads`` = (ident, [(file, line, func), ...] innermost first)."""
    out = []
    for i, (ident, frames) in enumerate(threads):
        out.append(f"{'Current thread' if i == 0 else 'Thread'} 0x{ident:016x} "
                   "(most recent call first):")
        out += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
        out.append("")
    return "\n".join(out)


HVD = os.path.dirname(group.__file__)
ENGINE = [(f"{HVD}/../collectives/engine.py", 300, "_loop"), (f"{HVD}/../collectives/engine.py", 240, "_main")]


def test_ranks_with_the_same_stack_show_once_with_the_user_frames_first():
    waiting = [(f"{HVD}/../collectives/handles.py", 60, "block"), ("/home/u/train.py", 12, "step"),
               ("/home/u/train.py", 30, "<module>")]
    other = [("/home/u/train.py", 17, "step"), ("/home/u/train.py", 30, "<module>")]
    stacks = [group.RankStack(r, group.parse(_dump((10 + r, waiting if r != 1 else other),
                                                   (99 + r, ENGINE))), main_ident=10 + r)
              for r in range(3)]
    stacks.append(group.RankStack(3, missing="did not answer within 2 s (stopped, or gone)"))
    text = group.render(stacks)
    assert "rank 0: waits in hvd_magic, called at /home/u/train.py:12 (in step)" in text
    assert "rank 1: runs /home/u/train.py:17 (in step), not in a collective" in text
    assert "rank 3: did not answer within 2 s" in text
    assert text.count("--- ranks 0,2 (the same stack) ---") == 1 and "--- rank 1 ---" in text
    block = text.split("--- ranks 0,2")[1].split("--- rank 1")[0]
    # the user's frames, innermost first, then what lies inside them, then library threads
    assert block.index("train.py\", line 12") < block.index("train.py\", line 30") \
        < block.index("inside it: 1 frame(s)") < block.index("1 thread(s) in library code only")


def test_a_dump_with_two_dumps_keeps_the_last():
    text = _dump((1, [("/a.py", 1, "f")])) + _dump((1, [("/a.py", 2, "f")]))
    assert [f.line for f in group.parse(text)[0].frames] == [2]


def test_marked_lines_of_ranks_on_other_hosts_interleaved_give_each_rank_s_stack():
    """What hvdrun reads from the job's stderr under -H: two ranks' marked lines mixed with
    each other and with the program's own output."""
    from hvd_magic.stacks.dump import END, FRAME, Framed
    framed = Framed()
    since = time.monotonic()
    dumps = {r: _dump((10 + r, [("/home/u/train.py", 40 + r, "<module>")])).splitlines()
             + [END.format(pid=100 + r, host="b", main=10 + r)] for r in (1, 2)}
    shown = []
    for a, b in zip(dumps[1], dumps[2]):
        for r, line in ((1, a), (2, b)):
            for text in (FRAME.format(rank=r) + line + "\n", "loss 0.5\n"):
                if not framed.feed(text):
                    shown.append(text)
    got = framed.wait([1, 2], since, 1.0)
    assert shown == ["loss 0.5\n"] * (2 * len(dumps[1]))
    assert [got[r].threads[0].frames[0].line for r in (1, 2)] == [41, 42]
    assert got[2].main_ident == 12
    assert framed.wait([3], since, 0.05) == {}


ELSEWHERE = """
import sys, time
from hvd_magic.stacks import dump
dump.install(1)
t0 = time.monotonic()
sum(range(10**7))
n = int(6.0 / max(time.monotonic() - t0, 1e-9) * 10**7)
print("READY", flush=True)
sum(range(n))         # HOLDS-GIL: one C call of several seconds that never looks for signals
"""


def test_a_rank_whose_host_lacks_the_stacks_directory_answers_from_c_through_its_watcher(tmp_path):
    """A rank on another host than its gatherer (here: the gatherer's directory does not
    exist) that holds the GIL in one C call: SIGUSR2 (what mpiexec forwards) reaches its watcher
    through Python's wake-up pipe; the watcher has faulthandler dump the stacks and writes
    them marked on the rank's stderr. The watcher ends with the rank, its dump file gone."""
    from hvd_magic.stacks.dump import Framed
    env = dict(os.environ, HVD_MAGIC_STACKS_DIR=str(tmp_path / "on-the-gatherer-s-host"))
    proc = subprocess.Popen([sys.executable, "-c", ELSEWHERE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "READY\n"
        watcher = psutil.Process(proc.pid).children()[0]
        assert watcher.cmdline()[1:3] == ["-m", "hvd_magic.stacks.watch"]
        dump_file = watcher.cmdline()[-1]
        time.sleep(0.3)                   # inside the long C call by now
        framed = Framed()
        since = time.monotonic()
        proc.send_signal(signal.SIGUSR2)
        for line in proc.stderr:          # (the rank's Python answer follows when it can)
            framed.feed(line)
            if framed.wait([1], since, 0.0):
                break
        took = time.monotonic() - since
        stack = framed.wait([1], since, 0.0)[1]
        assert took < 2.0, took           # from C: Python's handler waits for the call's end
        frames = stack.threads[0].frames
        assert frames[0].line == next(i for i, ln in enumerate(ELSEWHERE.splitlines(), 1)
                                      if "HOLDS-GIL" in ln), frames
        assert stack.main_ident
    finally:
        proc.kill()
        proc.wait()
    watcher.wait(5)
    assert not os.path.exists(dump_file)


def test_an_elastic_renumbering_starts_a_new_watcher_and_ends_the_old_one(tmp_path):
    """hvd.init() again (an elastic reset) as the same rank keeps the watcher; as another
    rank (renumbered) it replaces it, and the old one ends with its dump file."""
    code = """
import json, psutil, time
from hvd_magic.stacks import dump
def cmdline(c):     # a child that has just started may show an empty one for a moment
    deadline = time.monotonic() + 10
    while not c.cmdline() and time.monotonic() < deadline:
        time.sleep(0.01)
    return c.cmdline()
def watchers():     # (pid, rank, dump file) of each watcher this process runs
    return [(c.pid, cmdline(c)[-4], cmdline(c)[-1]) for c in psutil.Process().children()]
seen = []
for rank in (1, 1, 0):
    dump.install(rank)
    seen.append(watchers())
print(json.dumps(seen))
"""
    env = dict(os.environ, HVD_MAGIC_STACKS_DIR=str(tmp_path / "on-the-gatherer-s-host"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out
    first, again, renumbered = json.loads(out.stdout)
    assert len(first) == 1 and first[0][1] == "1" and again == first, out
    assert len(renumbered) == 1 and renumbered[0][1] == "0" and renumbered[0][0] != first[0][0]
    assert not os.path.exists(first[0][2])      # the old watcher ended and removed its file


def test_a_pool_log_gives_the_marked_answers_written_after_the_question(tmp_path):
    """What a notebook's pool reads from its mpiexec log: answers after ``offset`` only, a
    rank's answer that is still being written counts once it ends, a silent rank is left out
    after the timeout."""
    import threading
    from hvd_magic.stacks.dump import END, FRAME, answers_in

    def answer(r, line):
        body = _dump((10 + r, [("/home/u/train.py", line, "<module>")])).splitlines()
        return "".join(FRAME.format(rank=r) + x + "\n"
                       for x in body + [END.format(pid=100 + r, host="b", main=10 + r)])

    log = tmp_path / "mpiexec.log"
    log.write_text(answer(1, 7) + "an older line\n")          # an answer to an earlier question
    offset = log.stat().st_size
    late = answer(1, 41)
    with open(log, "a") as fh:
        fh.write("loss 0.5\n" + late[:len(late) // 2])

    def finish():
        time.sleep(0.2)
        with open(log, "a") as fh:
            fh.write(late[len(late) // 2:])
    writer = threading.Thread(target=finish)
    writer.start()
    got = answers_in(str(log), offset, [1], 2.0)
    writer.join()
    assert got[1].threads[0].frames[0].line == 41
    assert answers_in(str(log), offset, [1, 2], 0.1).keys() == {1}


# ---------------------------------------------------------------- hvdrun and mpiexec jobs

def _assert_both_ranks(err: str, marks=("WAIT-WEIGHT", "WAIT-BIAS"),
                       submits=(("grad.weight", "SUBMIT-WEIGHT"), ("grad.bias", "WAIT-BIAS"))):
    """Each rank's waiting line, the line that submitted what it waits for, and its stack."""
    for r, mark in enumerate(marks):
        n = line_of(mark)
        waits = f"rank {r}: waits in hvd_magic, called at {SCRIPT}:{n} (in <module>)"
        if submits:
            name, at = submits[r]
            waits += f"; it submitted allreduce '{name}' at {SCRIPT}:{line_of(at)}"
        assert waits in err, err
        stack = err.split(f"--- rank {r} ---")[1]
        assert f'File "{SCRIPT}", line {n}, in <module>' in stack.split("---")[0], err


def test_a_job_removes_the_stacks_directories_that_killed_jobs_left():
    """Ranks killed with SIGKILL cannot remove their stacks directory; the ranks of the next
    job on that host remove it (a directory whose launcher still runs stays)."""
    import socket
    import tempfile
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    base, uid, host = tempfile.gettempdir(), os.getuid(), socket.gethostname()
    stale = Path(base, f"hvd_magic-stacks-{uid}-prterun-{host}-{dead.pid}_1")
    live = Path(base, f"hvd_magic-stacks-{uid}-prterun-{host}-{os.getpid()}_1")
    for d in (stale, live):
        d.mkdir(exist_ok=True)
        (d / "0.pid").write_text("1 host 1\n")
    try:
        run_job([MPIEXEC, "-n", "2", sys.executable, "-c",
                 "import hvd_magic.collectives as h; h.init(); h.shutdown()"],
                mpi_env(), 60, "init")
        assert not stale.exists() and live.exists()
    finally:
        for d in (stale, live):
            subprocess.run(["rm", "-rf", str(d)])


def test_hvdrun_stall_names_each_rank_s_waiting_line_and_shows_both_stacks():
    proc = run_job([HVDRUN, "-np", "2", sys.executable, str(SCRIPT), "mismatch"],
                   mpi_env(STALL), 120, "hvdrun")
    assert proc.stdout.count("stall_stacks OK") == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "WARNING: stall" in err and "stall: the stacks of 2 rank(s)" in err, err
    assert err.index("WARNING: stall") < err.index("stall: the stacks")
    _assert_both_ranks(err)


def test_mpiexec_stall_shows_both_stacks_too():
    proc = mpirun("stall_stacks.py", 2, "mismatch", env=STALL, timeout=120)
    _assert_both_ranks(proc.stderr)


def test_a_rank_spinning_in_c_holding_the_gil_still_gives_its_stack():
    proc = run_job([HVDRUN, "-np", "2", sys.executable, str(SCRIPT), "gil"],
                   mpi_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}), 120, "hvdrun")
    assert proc.stdout.count("stall_stacks OK") == 2, proc.stdout + proc.stderr
    err = proc.stderr
    spin = line_of("SPIN-IN-C")
    assert f"rank 1: runs {SCRIPT}:{spin} (in spin_in_c), not in a collective" in err, err
    assert f"rank 0: waits in hvd_magic, called at {SCRIPT}:{line_of('WAIT-AFTER')}" in err, err
    # (rank 1's Python handler could answer only after its 6 s call: this answer is from C)


def sigusr1_stacks(argv: list, env: dict, ready_s: float = 90) -> tuple:
    """Run ``argv`` (hvdrun with stall_stacks.py ``usr1``), send SIGUSR1 to hvdrun once
    both ranks wait in their allreduce; ``(exit code, stderr)``."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_s
        while sum(line.startswith("READY") for line in lines) < 2:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"no READY from both ranks: {lines}\n{proc.communicate()}")
            time.sleep(0.05)
        time.sleep(1.0)                  # both ranks are inside their allreduce by now
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(5)
    return proc.returncode, err


def test_sigusr1_to_hvdrun_prints_every_rank_s_stack():
    env = mpi_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"})
    rc, err = sigusr1_stacks([HVDRUN, "-np", "2", sys.executable, str(SCRIPT), "usr1"], env)
    assert rc == 0, err
    assert "hvdrun: the stacks of 2 rank(s)" in err, err
    # (where each rank submitted what it waits for comes once the stall check's time is half
    # gone; this job has the stall check off)
    _assert_both_ranks(err, submits=None)


# ---------------------------------------------------------------- a notebook's pool

MISMATCH_CELL = """import numpy as np, hvd_magic.collectives as hvd
try:
    if hvd.rank() == 0:
        hvd.allreduce(np.ones(4), name='grad.weight')
    else:
        hvd.allreduce(np.ones(4), name='grad.bias')
except (hvd.StallError, hvd.ShutdownError):
    pass
print('over')
"""


def test_a_stall_in_a_cell_names_each_rank_s_cell_line_and_shows_both_stacks(tmp_path):
    pytest.importorskip("jupyter_client")
    from test_failures import Kernel
    k = Kernel(tmp_path / "kernel.log")
    try:
        settings = ", ".join(f"{k_}={v!r}" for k_, v in {**STALL, "HVD_MAGIC_WIDGETS": "0"}.items())
        assert k.run(f"import os\nos.environ.update({settings})")[0]["status"] == "ok"
        content, out = k.run(f"%%hvd -np 2\n{MISMATCH_CELL}", timeout=120)
    finally:
        k.stop()
    assert content["status"] == "ok", content
    assert "[0] over" in out and "[1] over" in out, out
    report = out[out.index("stall: the stacks of 2 rank(s)"):]
    # the cell's lines 4 and 6 (rank 0's and rank 1's allreduce), in the cell's file
    assert re.search(r"rank 0: waits in hvd_magic, called at (\S+):4 \(in <module>\); it "
                     r"submitted allreduce 'grad.weight' at \1:4", report), out
    assert re.search(r"rank 1: waits in hvd_magic, called at (\S+):6 \(in <module>\); it "
                     r"submitted allreduce 'grad.bias' at \1:6", report), out
    for r, n in ((0, 4), (1, 6)):
        stack = report.split(f"--- rank {r} ---")[1].split("---")[0]
        assert re.search(rf'File "\S+", line {n}, in <module>', stack), out


BUSY_CELL = """import re, time, hvd_magic.collectives as hvd
if hvd.rank() == 1:
    n = 20
    while True:                          # one long C call holding the GIL, again and again
        t0 = time.monotonic()
        re.match(r"(a*)*b", "a" * n)
        if time.monotonic() - t0 > 3:
            break
        n += 1
else:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4:
        time.sleep(0.01)
print('finished', hvd.rank())
"""


def test_hvd_stacks_on_a_busy_pool_answers_and_leaves_the_cell_running(capsys):
    from IPython.testing.globalipapp import get_ipython, start_ipython
    from test_pool import wait_no_pool_processes
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("reload_ext", "hvd_magic")
    try:
        assert ip.run_cell("%%hvd -np 2 --no-stream\n1").success
        done = {}
        cell = threading.Thread(target=lambda: done.setdefault(
            "res", ip.run_cell(f"%%hvd --no-stream\n{BUSY_CELL}")))
        cell.start()
        time.sleep(2.5)     # the cell runs on both ranks; rank 1 is inside re's C matcher
        capsys.readouterr()
        asked = time.monotonic()
        ip.run_line_magic("hvd", "stacks")
        took = time.monotonic() - asked
        text = capsys.readouterr().out
        assert cell.is_alive(), "the cell ended before the stacks were asked"
        cell.join(120)
        assert not cell.is_alive() and done["res"].success, done
        after = capsys.readouterr().out
    finally:
        ip.run_line_magic("hvd", "stop")
        ip.run_line_magic("unload_ext", "hvd_magic")
    assert "hvd: the stacks of 2 rank(s)" in text and "did not answer" not in text, text
    # rank 0 is in its wait loop: in the sleep (13), or at the loop's test (12) when the
    # signal came between two sleeps (a moment, longer when it waits for a busy core)
    assert re.search(r"rank 0: runs \S+:1[23] \(in <module>\), not in a collective", text), text
    assert re.search(r"rank 1: runs \S+:6 \(in <module>\), not in a collective", text), text
    assert "--- rank 1 ---" in text and "innermost __init__.py" in text.split("--- rank 1 ---")[1]
    # the cell went on and finished on both ranks (its output came at its end)
    assert "finished 0" in after and "finished 1" in after, after
    assert took < 30, took       # a hang guard only: gathering itself stops at 2 s
    assert not wait_no_pool_processes(5.0)


def test_the_live_panel_shows_each_rank_s_stack_under_its_lane_at_a_stall(monkeypatch):
    """The panel's model sees the stall (telemetry); the pool gathers the stacks while the
    cell runs and each lane gets a folded "stack" element that opens on a click in the
    browser (tests/test_browser.py drives a real one; here the widgets' values)."""
    pytest.importorskip("ipywidgets")
    from IPython.testing.globalipapp import get_ipython, start_ipython
    from hvd_magic.kernel import PoolManager
    from hvd_magic.widgets.panel import WidgetSink
    start_ipython() or get_ipython()
    for k_, v in STALL.items():
        monkeypatch.setenv(k_, v)
    manager = PoolManager()
    try:
        pool = manager.ensure(2, None, None, None)
        sink = WidgetSink(ranks=[0, 1])
        pool.run_cell(MISMATCH_CELL, sink)
        stacks = {r: w.value for r, w in sink.stack_ws.items()}
    finally:
        manager.stop()
    for r, n in ((0, 4), (1, 6)):
        html = stacks[r]
        assert html.startswith(f"<details class='hvdm-stack' data-rank='{r}'><summary>"), stacks
        assert re.search(rf"rank {r}: waits in hvd_magic, called at \S+:{n} ", html), html
        assert re.search(rf"File &quot;\S+&quot;, line {n}, in &lt;module&gt;", html), html
