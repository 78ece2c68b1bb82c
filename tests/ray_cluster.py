"""A real two-node Ray cluster for tests: a head node (``ray start --head``) in one network
namespace and a worker node (``ray start --address``) in another, joined by a veth pair
(tests/netns_hosts.py), as on two machines.

:func:`two_nodes` starts it and, at the end, stops it by killing the processes in its two
namespaces (``ray stop`` would end every Ray process on the machine, other runs' included).
A module that starts one gives its own subnet, namespace prefix and port, so that two never
share a cluster or a name. A driver run on it prints one ``RESULT <json>`` line:
:func:`result` reads it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, Tuple

import netns_hosts

VENV_BIN = os.path.dirname(sys.executable)


def result(proc: subprocess.CompletedProcess) -> dict:
    """The ``RESULT <json>`` line a driver printed last, as a dict; fails showing both
    streams when the driver failed or printed none."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"driver exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@contextlib.contextmanager
def two_nodes(subnet: str, prefix: str, port: int) -> Iterator[Tuple["netns_hosts.TwoHosts",
                                                                     str, Dict[str, str]]]:
    """``(hosts, "HEAD_IP:PORT", env)`` of a running cluster (``env``: for ``ray`` and
    drivers); everything in both namespaces is killed afterwards."""
    netns_hosts.clean_stale((f"{prefix}A-", f"{prefix}B-"))
    hosts = netns_hosts.TwoHosts(subnet=subnet, prefix=prefix).create()
    # Ray's sockets live under its temp dir: a short path of our own (AF_UNIX paths are
    # limited to 107 bytes), shared by both nodes and removed afterwards
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
               RAY_USAGE_STATS_ENABLED="0")
    common = ["--num-cpus", "1", "--disable-usage-stats", "--temp-dir", temp,
              "--object-store-memory", str(100 * 2**20), "--include-log-monitor", "false"]
    try:
        start_node(hosts, hosts.a, env, ["--head", "--node-ip-address", hosts.a.ip,
                                         "--port", str(port), "--include-dashboard", "false",
                                         *common], temp)
        start_node(hosts, hosts.b, env, ["--address", f"{hosts.a.ip}:{port}",
                                         "--node-ip-address", hosts.b.ip, *common], temp)
        yield hosts, f"{hosts.a.ip}:{port}", env
    finally:
        hosts.destroy()
        shutil.rmtree(temp, ignore_errors=True)


def start_node(hosts, host, env, args, temp: str, tries: int = 3) -> None:
    """``ray start ARGS`` on ``host``. ``ray start`` gives up when its node has not
    registered with the head within a fixed 30 s, but leaves the node's processes running:
    on a loaded machine they often register soon after, which the head's log shows. A node
    that has not within 120 s is killed and started again."""
    for attempt in range(tries):
        proc = hosts.run([f"{VENV_BIN}/ray", "start", *args], env=env, timeout=180, host=host)
        if proc.returncode == 0:
            return
        if "timed out during startup" not in proc.stderr + proc.stdout:
            raise AssertionError(f"ray start {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if registered(temp, host.ip):
                return
            time.sleep(1)
        if attempt == tries - 1:
            raise AssertionError(f"ray start {' '.join(args)}: the node did not register "
                                 f"within 150 s:\n{proc.stdout}\n{proc.stderr}")
        for pid in netns_hosts.netns_pids(host.ns):
            os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while netns_hosts.netns_pids(host.ns) and time.monotonic() < deadline:
            time.sleep(0.1)


def registered(temp: str, ip: str) -> bool:
    """Whether the head's GCS has registered a node at ``ip`` (its log says so)."""
    for path in glob.glob(os.path.join(temp, "session_*", "logs", "gcs_server.out")):
        with open(path, errors="replace") as fh:
            if any("Registering new node" in line and f"node_address={ip}" in line
                   for line in fh):
                return True
    return False
