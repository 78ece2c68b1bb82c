"""Driver of the Ray pool tests, run as the notebook kernel would be (on the Ray head's
host for a cluster): ``python ray_pool.py SCENARIO [ADDRESS NS_A NS_B]``; prints one
``RESULT {json}`` line.

``cluster``: ``%%hvd -np 2 --ray ADDRESS`` cells through a real IPython shell: an
allreduce, state kept between cells, ``%hvd status``, a cell's telemetry (the panel's data,
in its text form), ``%hvd stacks`` while a cell runs,
where the controller listens, ``%hvd export`` of the first two cells (the Ray driver it writes
is run after ``%hvd stop``), ``%hvd stop`` (the ranks' atexit handlers run); then a new pool, a cell that runs while rank 1's engine is killed, and how
long until the cell ended and what it said.

``local``: ``%%hvd -np 2 --ray`` (a Ray started for the pool): an allreduce, what the Ray
processes it started listen on, a cell while rank 1's engine is killed (and its actor
stopped for 4 s), ``%hvd stop``, and which of the processes are left.
"""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from netns_hosts import netns_pids  # noqa: E402

scenario = sys.argv[1]
address = sys.argv[2] if len(sys.argv) > 2 else None
namespaces = sys.argv[3:5]
res = {}

from IPython.testing.globalipapp import start_ipython  # noqa: E402

shell = start_ipython()
shell.run_line_magic("load_ext", "hvd_magic")
mg = shell.magics_manager.registry["HvdMagics"]
ray_arg = f"--ray {address}" if address else "--ray"

ALLREDUCE = """
import socket
import numpy as np
import hvd_magic.collectives as hvd
w = np.full(3, float(hvd.rank() + 1))
hvd.allreduce_(w, op=hvd.Sum)
(hvd.rank(), hvd.size(), w.tolist())
"""


def out(name):
    return {str(r): list(v) for r, v in shell.user_ns[name].items()}


def captured(fn):
    """What ``fn()`` printed (the pool's status lines go to stderr), also passed through."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        fn()
    sys.stderr.write(buf.getvalue())
    return buf.getvalue()


def listening(pids, names=False):
    found = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = " ".join(psutil.Process(c.pid).cmdline())[:80] if names else ""
            except psutil.Error:
                name = "?"
            found.add((c.laddr.ip, c.laddr.port) + ((name,) if names else ()))
    return sorted(found)


def engines_and_workers():
    """Processes in the cluster's namespaces that are a pool engine or a Ray pool actor."""
    found = []
    for pid in [p for ns in namespaces for p in netns_pids(ns)]:
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if "hvd_magic.kernel.ranks.engine" in cmd or "BaseHorovodWorker" in cmd:
            found.append(f"{pid} {cmd[:160]}")
    return found


def gone_within(pids, limit):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.1)
    return False


if scenario == "cluster":
    res["start_text"] = captured(lambda: shell.run_cell_magic(
        "hvd", f"-np 2 {ray_arg} --out first", ALLREDUCE))
    res["first"] = out("first")
    pool = mg.manager.pool
    res["engine_interface"] = pool.plan.engine_info["interface"]
    res["hosts"] = {str(r): h for r, h in pool.hosts.items()}
    ctl = psutil.Process(pool.controller.pid)
    res["controller_listen"] = listening({ctl.pid} | {c.pid for c in
                                                      ctl.children(recursive=True)})
    shell.run_cell_magic("hvd", "--out second", "w += hvd.allreduce(w, op=hvd.Sum)\n"
                                                "(hvd.rank(), w.tolist())")
    res["second"] = out("second")
    # %hvd export of the two cells so far: a Ray driver, run below once the pool is gone
    exported = os.path.join(tempfile.mkdtemp(prefix="hvd-export-"), "exported.py")
    res["export_said"] = captured(lambda: shell.run_line_magic("hvd", f"export {exported}"))
    try:
        shell.run_cell_magic("hvd", "--timeout 2", "import time\ntime.sleep(30)\n")
        res["timeout"] = "no exception"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        res["timeout"] = f"{type(exc).__name__}: {exc}"
    shell.run_cell_magic("hvd", "--out third", "(hvd.rank(), w.tolist())")
    res["third"] = out("third")
    res["same_pool"] = mg.manager.pool is pool
    # %hvd push / pull: a value from here to both ranks, and back from each
    shell.user_ns["k"] = 7
    shell.run_line_magic("hvd", "push k")
    shell.run_cell_magic("hvd", "", "kw = [k * (hvd.rank() + 1), w.tolist()]")
    shell.run_line_magic("hvd", "pull kw")
    res["pulled"] = shell.user_ns["kw"]
    res["status"] = captured(lambda: shell.run_line_magic("hvd", "status"))
    # the live panel's data (telemetry of both ranks), as its text form sums it up
    res["telemetry"] = captured(lambda: shell.run_cell_magic("hvd", "", (
        "import time\nfrom hvd_magic.widgets import report\n"
        "g = np.ones(1 << 16, dtype=np.float32)\n"
        "for step in range(40):\n"
        "    hvd.allreduce_(g, name='grad')\n"
        "    time.sleep(0.02)\n"
        "    report(samples=32)\n")))
    # %hvd stacks while a cell sleeps on both nodes (each rank on its own line)
    done = {}
    cell = threading.Thread(target=lambda: done.setdefault("ok", shell.run_cell(
        "%%hvd --no-stream\nimport time\nt0 = time.monotonic()\n"
        "while time.monotonic() - t0 < 5:\n"
        "    time.sleep(0.01) if hvd.rank() == 0 else time.sleep(0.02)\n").success))
    cell.start()
    time.sleep(2.0)
    t0 = time.monotonic()
    res["stacks"] = captured(lambda: shell.run_line_magic("hvd", "stacks"))
    res["stacks_s"] = time.monotonic() - t0
    res["stacks_running"] = cell.is_alive()
    cell.join(60)
    res["stacks_cell_ok"] = done.get("ok")
    engines = list(pool.engine_pids.values())
    # each rank ends as a script's process does: its atexit handlers run
    ended = tempfile.mkdtemp(prefix="hvd-atexit-")
    shell.run_cell_magic("hvd", "", "import atexit\natexit.register(lambda: open("
                         f"'{ended}/%d' % hvd.rank(), 'w').write('saved'))\n")
    shell.run_line_magic("hvd", "stop")
    res["stopped_clean"] = gone_within(engines, 10.0)
    res["atexit_ran_on"] = sorted(os.listdir(ended))
    shutil.rmtree(ended)
    time.sleep(1.0)
    res["left_after_stop"] = engines_and_workers()
    # the exported script, as its header says to run it (its workers get this process's
    # GLOO_SOCKET_IFNAME, as the pool's ranks did)
    try:
        ran = subprocess.run([sys.executable, exported], capture_output=True, text=True,
                             timeout=180)
        res["exported_run"] = [ran.returncode, ran.stdout, ran.stderr[-4000:]]
    finally:
        shutil.rmtree(os.path.dirname(exported))
    res["left_after_export"] = engines_and_workers()

    # a new pool; rank 1's engine is killed while a cell runs
    shell.run_cell_magic("hvd", f"-np 2 {ray_arg}", "x = 1")
    pool = mg.manager.pool
    victim = pool.engine_pids[1]
    killed = {}

    def kill():
        time.sleep(2.0)
        killed["at"] = time.monotonic()
        os.kill(victim, 9)

    threading.Thread(target=kill, daemon=True).start()
    try:
        shell.run_cell_magic("hvd", "", "import time\nfor _ in range(600): time.sleep(0.1)\n")
        res["killed"] = "no exception"
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        res["killed"] = f"{type(exc).__name__}: {exc}"
    res["killed_after_s"] = time.monotonic() - killed.get("at", time.monotonic())
    print(f"killed rank 1's engine: the cell ended {res['killed_after_s']:.2f} s later",
          file=sys.stderr)
    res["victim_node"] = pool.hosts.get(1)
    res["after_death_clean"] = gone_within(list(pool.engine_pids.values()), 10.0)
    time.sleep(1.0)
    res["left_after_death"] = engines_and_workers()
    shell.run_line_magic("hvd", "stop")

elif scenario == "local":
    me = psutil.Process()
    res["start_text"] = captured(lambda: shell.run_cell_magic(
        "hvd", f"-np 2 {ray_arg} --out first", ALLREDUCE))
    res["first"] = out("first")
    pool = mg.manager.pool
    started = [p.pid for p in me.children(recursive=True)]
    res["listen"] = listening(set(started), names=True)
    shell.run_cell_magic("hvd", "--out second", "w += 1\n(hvd.rank(), w.tolist())")
    res["second"] = out("second")
    res["netns"] = pool.config.netns
    # rank 1's engine killed while a cell runs: the cell ends naming it, the pool stops;
    # its actor answers late (stopped for longer than the heartbeat's 3 s, as on a loaded
    # machine), and the cell still says it was killed, not paused
    victim = pool.engine_pids[1]
    actor = psutil.Process(victim).ppid()

    stalled = {}

    def kill_and_stall_the_actor():
        os.kill(actor, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        stalled["at"] = time.monotonic()
        time.sleep(4.0)
        os.kill(actor, signal.SIGCONT)
        stalled["resumed_after_s"] = time.monotonic() - stalled["at"]

    threading.Timer(2.0, kill_and_stall_the_actor).start()
    try:
        shell.run_cell_magic("hvd", "", "import time\nfor _ in range(600): time.sleep(0.1)\n")
        res["killed"] = "no exception"
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        res["killed"] = f"{type(exc).__name__}: {exc}"
    # when the cell ended, from the kill (the actor answers after its SIGCONT, 4 s)
    ended_at = time.monotonic()
    res["killed_timing"] = {
        "cell_ended_after_s": ended_at - stalled["at"] if "at" in stalled else None,
        "actor_resumed_after_s": stalled.get("resumed_after_s")}
    started = list(set(started) | {p.pid for p in me.children(recursive=True)})
    shell.run_line_magic("hvd", "stop")
    res["stopped_clean"] = gone_within(started, 15.0)
    res["left"] = [" ".join(psutil.Process(p).cmdline())[:160] for p in started
                   if psutil.pid_exists(p)
                   and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

print("RESULT " + json.dumps(res), flush=True)
