"""What a user sees when something goes wrong, through a real Jupyter kernel (driven by
jupyter_client, as a notebook drives it) and a real pool, at 2 and 3 ranks."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("jupyter_client")
from test_pool import pool_processes, wait_no_pool_processes  # noqa: E402


class Kernel:
    """A python3 kernel with hvd_magic loaded; its own output (tornado's log) goes to a file."""

    def __init__(self, log_path):
        from jupyter_client.manager import KernelManager
        self.log_path = log_path
        self.km = KernelManager(kernel_name="python3")
        with open(log_path, "w") as log:
            self.km.start_kernel(stdout=log, stderr=log)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        assert self.run("%load_ext hvd_magic")[0]["status"] == "ok"

    def run(self, code, timeout=60):
        """Run ``code``; returns (reply content, the text it printed)."""
        outs = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                outs.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return reply["content"], "".join(outs)

    def pids(self):
        """{rank: pid} of the running pool's ranks, as the ranks report them."""
        content, text = self.run("%%hvd --no-stream\nimport os\nos.getpid()")
        assert content["status"] == "ok", content
        return {int(r): int(p) for r, p in re.findall(r"\[(\d+)\] Out: (\d+)", text)}

    def stop(self):
        self.km.shutdown_kernel()
        self.kc.stop_channels()

    def log(self):
        with open(self.log_path) as fh:
            return fh.read()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("kernel") / "kernel.log")
    yield k
    k.stop()
    assert not wait_no_pool_processes(5.0)
    # replacing and stopping pools closed every stream before its socket
    assert "Uncaught exception" not in k.log() and "ZMQError" not in k.log(), k.log()


def _gone(pids):
    def dead(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True
    return all(dead(p) for p in pids)


CELLS = {
    # rank 0.. wait in an allreduce that the paused rank never joins again
    "collective": "import numpy as np, hvd_magic.collectives as hvd\n"
                  "for i in range(10 ** 7):\n    hvd.allreduce(np.ones(4), name='step')",
    # the others compute, not communicating at all
    "compute": "import time\nt = time.time()\nwhile time.time() - t < 25:\n    pass",
}


def _started(marks, np_, timeout=30.0):
    """Wait until every rank has written its mark: the cell runs everywhere."""
    deadline = time.monotonic() + timeout
    while len(list(marks.glob("started-*"))) < np_:
        assert time.monotonic() < deadline, "the cell did not start on every rank"
        time.sleep(0.05)


def _assert_names_the_paused_rank(content, victim, pids, ename="RankDiedError"):
    assert content["status"] == "error" and content["ename"] == ename, content
    text = content["evalue"]
    assert f"rank {victim} (pid {pids[victim]} on " in text and "stopped answering" in text
    assert "paused" in text and "next %%hvd cell starts a new one" in text
    assert _gone(pids.values())              # the stopped rank too


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("where", sorted(CELLS))
def test_a_paused_rank_ends_the_cell_naming_it(kernel, tmp_path, np_, where):
    assert kernel.run(f"%%hvd -np {np_} --no-stream\n1")[0]["status"] == "ok"
    pids = kernel.pids()
    assert sorted(pids) == list(range(np_))
    victim = np_ - 1
    mark = f"import os\nopen(os.path.join({str(tmp_path)!r}, f'started-{{os.getpid()}}'), 'w')\n"
    msg_id = kernel.kc.execute(f"%%hvd\n{mark}{CELLS[where]}", stop_on_error=False)
    _started(tmp_path, np_)
    os.kill(pids[victim], signal.SIGSTOP)    # a debugger, Ctrl-Z, a frozen host
    paused = time.monotonic()
    reply = kernel.kc.get_shell_msg(timeout=30)
    took = time.monotonic() - paused
    assert reply["parent_header"]["msg_id"] == msg_id
    _assert_names_the_paused_rank(reply["content"], victim, pids)
    assert took < 5.0, took
    content, out = kernel.run("%%hvd --no-stream\nimport hvd_magic.collectives as hvd\n"
                              "hvd.size()")
    assert content["status"] == "ok", content
    assert "the previous pool ended (rank" in out and f"[{victim}] Out: {np_}" in out


@pytest.mark.parametrize("code", ["%%hvd --no-stream\nprint(1)", "%%hvd\nprint(1)",
                                  "%hvd pull x"])
def test_a_rank_paused_between_cells_ends_the_next_one_naming_it(kernel, code):
    """Paused while the pool is idle: the next cell (which first switches the live panel's
    telemetry when it streams), or a pull, ends naming the rank instead of hanging or
    showing ipyparallel's CompositeError."""
    assert kernel.run("%%hvd -np 2 --no-stream\nx = 1")[0]["status"] == "ok"
    pids = kernel.pids()
    os.kill(pids[1], signal.SIGSTOP)
    paused = time.monotonic()
    content, _ = kernel.run(code, timeout=30)
    assert time.monotonic() - paused < 5.0
    # a line magic's error is one UsageError line: "%hvd pull x: RankDiedError: rank 1 ..."
    _assert_names_the_paused_rank(content, 1, pids,
                                  "UsageError" if code.startswith("%hvd ") else "RankDiedError")


def test_a_rank_that_computes_holding_the_gil_is_not_declared_dead(kernel):
    """10 s (over three times the heartbeat's limit of 3 s) with the interpreter's switch
    interval at 100 s: no Python thread of the rank runs meanwhile, but its heartbeat (a
    zmq thread outside the interpreter) still answers."""
    from hvd_magic.kernel.notebook.plan import HEARTBEAT_MISSES, HEARTBEAT_MS
    hold = 10
    assert hold >= 3 * HEARTBEAT_MISSES * HEARTBEAT_MS / 1000
    assert kernel.run("%%hvd -np 2 --no-stream\n1")[0]["status"] == "ok"
    t0 = time.monotonic()
    content, out = kernel.run(
        "%%hvd --no-stream\nimport sys, time\nsys.setswitchinterval(100)\nt = time.time()\n"
        f"while time.time() - t < {hold}:\n    pass\nsys.setswitchinterval(0.005)\n"
        "print('done')")
    assert content["status"] == "ok", content
    assert time.monotonic() - t0 >= hold and "[0] done" in out and "[1] done" in out


def test_impossible_requests_start_nothing(kernel):
    kernel.run("%hvd stop")
    before = pool_processes()
    t0 = time.monotonic()
    content, out = kernel.run("%%hvd -np 100000\nprint(1)")
    assert time.monotonic() - t0 < 5
    cores = os.cpu_count()
    assert content["ename"] == "UsageError", content
    assert (f"-np 100000 is more than this machine holds: at most {4 * cores} ranks "
            f"(4 per core x {cores} cores)") in content["evalue"]
    assert "--oversubscribe" in content["evalue"]
    assert pool_processes() == before
    assert kernel.run("%%hvd -np 2 --no-stream\n1")[0]["status"] == "ok"
    content, out = kernel.run("%%hvd --rank 5\nprint(1)")
    assert content["ename"] == "UsageError", content
    assert content["evalue"] == "rank(s) [5] do not exist in a pool of 2 ranks (0..1)"
    assert "Traceback" not in out and "args.py" not in out and "magics.py" not in out


def test_live_cells_keep_a_bounded_number_of_widgets(kernel):
    """Each live cell makes a panel (about 50 widgets and a bokeh document, 0.4 MB of the
    kernel); only the last 10 stay open, so after 10 cells the count of open widgets stays
    put. The kernel's memory over 1,000 cells: benchmarks/kernel_memory.py."""
    assert kernel.run("%%hvd -np 2 --no-stream\nimport numpy as np\n"
                      "import hvd_magic.collectives as hvd")[0]["status"] == "ok"
    cell = "%%hvd\nx = hvd.allreduce(np.ones(4)); print('step', x[0])"
    count = ("import gc, ipywidgets\ngc.collect()\nprint('OPEN', sum(1 for o in gc.get_objects()"
             " if isinstance(o, ipywidgets.Widget) and o.comm is not None))")

    def cells(n):
        for _ in range(n):
            assert kernel.run(cell)[0]["status"] == "ok"
        return int(kernel.run(count)[1].split("OPEN")[1])

    seen = [cells(12), cells(6), cells(6), cells(6)]
    assert seen[-1] == seen[-2] == seen[-3] and seen[-1] < 10 * 80, seen
