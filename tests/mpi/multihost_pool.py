"""Driver of the multi-host pool tests, run on host A as the notebook kernel would be:
``python multihost_pool.py SCENARIO HOSTS NS_A NS_B``; prints one ``RESULT {json}`` line.

``magics``: ``%%hvd -np 2 -H HOSTS`` cells through a real IPython shell; where the pool's
controller listens; a cell past its ``--timeout`` (interrupts go through the nannies on
both hosts); ``%hvd stop``, then how long until both namespaces are empty.

``stacks``: ``%hvd stacks`` while a cell runs on both hosts (rank 0 sleeps, rank 1 on
host B too, on another line): what it printed and how long it took, and the cell's end.

``oversubscribe``: the Pool API with ``HVD_MAGIC_OVERSUBSCRIBE=1`` and more ranks than
slots: where each rank landed; stop, and how long until both namespaces are empty.
"""
import contextlib
import io
import json
import os
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from netns_hosts import netns_pids  # noqa: E402

scenario, hosts, ns_a, ns_b = sys.argv[1:5]
ME = os.getpid()


def wait_empty(res, t_stop, limit=10.0):
    """Poll both namespaces until only this process is left; record what lingered."""
    seen = {}
    deadline = time.monotonic() + limit
    while True:
        pids = [p for ns in (ns_a, ns_b) for p in netns_pids(ns) if p != ME]
        now = time.monotonic() - t_stop
        for pid in pids:
            if pid not in seen:
                try:
                    seen[pid] = {"cmd": " ".join(psutil.Process(pid).cmdline())[:200],
                                 "first": now}
                except psutil.Error:
                    continue
            seen[pid]["last"] = now
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    res["empty_after_s"] = time.monotonic() - t_stop
    res["lingered"] = list(seen.values())          # what was still there after stop, how long
    res["left"] = [seen[p]["cmd"] for p in pids if p in seen]


def magics(res):
    from IPython.testing.globalipapp import start_ipython
    shell = start_ipython()
    shell.run_line_magic("load_ext", "hvd_magic")
    mg = shell.magics_manager.registry["HvdMagics"]

    def out(name):
        return {str(r): list(v) for r, v in shell.user_ns[name].items()}

    t0 = time.monotonic()
    shell.run_cell_magic("hvd", f"-np 2 -H {hosts} --out first", """
import socket
import numpy as np
import hvd_magic.collectives as hvd
w = np.full(3, float(hvd.rank() + 1))
hvd.allreduce_(w, op=hvd.Sum)
import os
(socket.gethostname(), hvd.rank(), hvd.local_size(), hvd.cross_size(), w.tolist(),
 os.environ.get("OMPI_MCA_btl_tcp_if_include"))
""")
    res["first_s"] = time.monotonic() - t0
    res["first"] = out("first")
    pool = mg.manager.pool
    res["single_host"] = pool.plan.single_host
    res["engine_interface"] = pool.plan.engine_info["interface"]
    res["registration_port"] = pool.plan.engine_info["registration"]

    # where the controller (and its schedulers) listen: this namespace's sockets
    ctl = psutil.Process(pool.controller.pid)
    ctl_pids = {ctl.pid} | {c.pid for c in ctl.children(recursive=True)}
    res["controller_listen"] = sorted({(c.laddr.ip, c.laddr.port)
                                       for c in psutil.net_connections(kind="inet")
                                       if c.status == psutil.CONN_LISTEN and c.pid in ctl_pids})

    # state kept across cells, on both hosts
    shell.run_cell_magic("hvd", "--out second", """
w += hvd.allreduce(w, op=hvd.Sum)
(socket.gethostname(), w.tolist())
""")
    res["second"] = out("second")

    # past --timeout: interrupted on both hosts (through the nannies), the pool stays
    t1 = time.monotonic()
    try:
        shell.run_cell_magic("hvd", "--timeout 1", "import time\ntime.sleep(20)\n")
        res["timeout"] = "no exception"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        res["timeout"] = f"{type(exc).__name__}: {exc}"
    res["timeout_s"] = time.monotonic() - t1
    shell.run_cell_magic("hvd", "--out third", "(socket.gethostname(), w.tolist())")
    res["third"] = out("third")
    res["same_pool"] = mg.manager.pool is pool

    status = io.StringIO()
    with contextlib.redirect_stdout(status):
        shell.run_line_magic("hvd", "status")
    res["status"] = status.getvalue()

    t2 = time.monotonic()
    shell.run_line_magic("hvd", "stop")
    res["stop_s"] = time.monotonic() - t2
    wait_empty(res, t2)
    res["workdir_gone"] = not os.path.exists(pool.config.workdir)


def oversubscribe(res):
    from hvd_magic.kernel import PoolManager, TextSink
    from hvd_magic.runner.plan import parse_hosts
    os.environ["HVD_MAGIC_OVERSUBSCRIBE"] = "1"
    manager = PoolManager()
    try:
        pool = manager.ensure(3, parse_hosts(hosts), None, TextSink())
        res["policy"] = pool.plan.engine_env.get("PRTE_MCA_rmaps_default_mapping_policy")
        cell = pool.run_cell(
            "import socket, numpy as np, hvd_magic.collectives as hvd\n"
            "(socket.gethostname(), hvd.local_rank(), hvd.local_size(),\n"
            " float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0]))", TextSink())
        res["ranks"] = {str(r): v["text/plain"] for r, v in cell.results.items()}
    finally:
        t2 = time.monotonic()
        manager.stop()
        wait_empty(res, t2)


STACKS_CELL = """import time, hvd_magic.collectives as hvd
t0 = time.monotonic()
if hvd.rank() == 1:
    while time.monotonic() - t0 < 5:
        time.sleep(0.02)                     # ON-B
else:
    while time.monotonic() - t0 < 5:
        time.sleep(0.01)                     # SLEEP-ON-A
print('finished', hvd.rank())
"""


def stacks(res):
    import threading
    from IPython.testing.globalipapp import start_ipython
    shell = start_ipython()
    shell.run_line_magic("load_ext", "hvd_magic")
    try:
        shell.run_cell_magic("hvd", f"-np 2 -H {hosts} --no-stream", "1")
        done = {}
        everything = io.StringIO()       # the cell's output and the stacks, as printed
        with contextlib.redirect_stdout(everything):
            cell = threading.Thread(target=lambda: done.setdefault(
                "ok", shell.run_cell("%%hvd --no-stream\n" + STACKS_CELL).success))
            cell.start()
            time.sleep(2.0)
            before = len(everything.getvalue())
            t0 = time.monotonic()
            shell.run_line_magic("hvd", "stacks")
            res["took_s"] = time.monotonic() - t0
            res["text"] = everything.getvalue()[before:]
            res["running"] = cell.is_alive()
            cell.join(60)
        res["cell_ok"] = done.get("ok")
        res["output"] = everything.getvalue()
    finally:
        t2 = time.monotonic()
        shell.run_line_magic("hvd", "stop")
        wait_empty(res, t2)


res = {}
{"magics": magics, "oversubscribe": oversubscribe, "stacks": stacks}[scenario](res)
print("RESULT " + json.dumps(res), flush=True)
