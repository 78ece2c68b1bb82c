"""Two "hosts" on this machine for multi-host tests: network namespaces joined by a veth pair.

:class:`TwoHosts` makes namespaces ``hvdA-<pid>`` (10.231.0.1) and ``hvdB-<pid>``
(10.231.0.2), each with ``lo`` up and its end of the veth pair named ``hvd0`` (as if
both machines had an ``eth0``), and an ssh stand-in (the *agent*) for Open MPI's PRRTE:
``agent HOST COMMAND...`` runs COMMAND in HOST's namespace the way ``ssh`` would on a real
machine: under that host's own hostname (a private UTS namespace, ``unshare -u``; the real
hostname never changes), with its own empty ``/tmp`` (a private mount namespace), with a
remote shell's bare environment (``env -i`` with a system PATH and HOME only), and detached
from the caller (``setsid -f``), so the daemon and ranks on the other host are not children
of ``mpiexec`` here. What both hosts must see goes under ``TwoHosts.shared``, not ``/tmp``.
:meth:`TwoHosts.wrap` runs a command on host A under hostname A with the normal environment
and file system: that is where the tests start ``hvdrun``, ``hvd_magic.run`` and the pool's
kernel side.

Nothing here touches the real network: both veth ends live in the namespaces, and the
addresses exist only there. :meth:`TwoHosts.destroy` kills whatever still runs in either
namespace (returning what it found) and deletes namespaces and veth pair.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

SUBNET = "10.231.0.0/24"
PREFIX = 24
IFNAME = "hvd0"          # the veth end's name inside each namespace


@dataclass(frozen=True)
class NetnsHost:
    """One namespace acting as a host."""

    ns: str          # namespace name, also this host's hostname
    ip: str
    veth: str        # the veth end's name until it is moved in (then IFNAME)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def unusable_reason() -> Optional[str]:
    """Why two-namespace hosts cannot be made here (None when they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "multi-host tests need root (they make network namespaces with `ip netns`)"
    for tool in ("ip", "unshare", "setsid", "env"):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}`, which is not installed"
    probe = f"hvdP-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    try:
        up = _ip("-n", probe, "link", "set", "lo", "up", check=False)
        if up.returncode != 0:
            return f"cannot configure a network namespace here: {up.stderr.strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(prefixes: Sequence[str] = ("hvdA-", "hvdB-", "hvdP-")) -> List[str]:
    """Delete namespaces that earlier runs of these tests left behind (their pid is gone),
    killing what still runs in them. Returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ")[0].strip()
        if not name.startswith(tuple(prefixes)):
            continue
        owner = name.split("-", 1)[1]
        if not owner.isdigit() or _alive(int(owner)):
            continue
        for pid in netns_pids(name):
            _kill(pid)
        _ip("netns", "delete", name, check=False)
        removed.append(name)
    return removed


def netns_pids(ns: str) -> List[int]:
    """Processes whose network namespace is ``ns`` (read from /proc, like `ip netns pids`,
    but without a child process that would count itself when called inside ``ns``)."""
    try:
        want = os.stat(f"/run/netns/{ns}")
    except OSError:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (want.st_ino, want.st_dev) and not _zombie(int(entry)):
            out.append(int(entry))
    return out


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def describe_pids(pids: Sequence[int]) -> List[str]:
    """``"pid: command line"`` for each of ``pids`` still running."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                line = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append(f"{pid}: {line[:200]}")
    return out


AGENT = """#!/bin/sh
# ssh stand-in for PRRTE (plm_ssh_agent): agent [ssh options] HOST COMMAND...
# Runs COMMAND in HOST's network namespace under HOST's own hostname, with its own empty
# /tmp and a remote shell's bare environment, detached from the caller like a daemon
# started over ssh.
echo "$(date +%T.%N) agent $*" >> {log}
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
# A checkout under /tmp (KEEP) stays visible: bound aside, then back over the empty /tmp.
exec setsid -f ip netns exec "$ns" unshare -u -m sh -c \\
  'if [ -n "$3" ]; then mkdir -p /run/hvdm-keep && mount --bind "$3" /run/hvdm-keep; fi &&
   mount -t tmpfs -o mode=1777 tmp /tmp &&
   if [ -n "$3" ]; then mkdir -p "$3" && mount --bind /run/hvdm-keep "$3"; fi &&
   hostname "$0" &&
   exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$2" sh -c "$1"' \\
  "$ns" "$*" "${{HOME:-/}}" {keep}
"""


def _checkout_under_tmp() -> str:
    """This checkout's root when it lies under /tmp (a CI clone, say), else ``""``: host B
    gets its own empty /tmp, which would hide the venv the ranks there run."""
    root = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    return root if root == "/tmp" or root.startswith("/tmp/") else ""


def _address(h: NetnsHost) -> None:
    """``h``'s address on its IFNAME, which comes up with its loopback."""
    _ip("-n", h.ns, "addr", "add", f"{h.ip}/{PREFIX}", "dev", IFNAME)
    _ip("-n", h.ns, "link", "set", IFNAME, "up")
    _ip("-n", h.ns, "link", "set", "lo", "up")


class TwoHosts:
    """Namespaces A and B joined by a veth pair, plus the agent; see the module docstring."""

    def __init__(self, tag: Optional[str] = None, subnet: str = SUBNET,
                 prefix: str = "hvd") -> None:
        """``subnet``: a /24 whose .1 and .2 the hosts get; ``prefix``: of the namespace
        names (``{prefix}A-{tag}``), so that tests of several modules never share names."""
        tag = tag or str(os.getpid())
        base = subnet.split("/")[0].rsplit(".", 1)[0]
        self.subnet = subnet
        self.a = NetnsHost(f"{prefix}A-{tag}", f"{base}.1", f"{prefix[:-1]}A{tag}"[:15])
        self.b = NetnsHost(f"{prefix}B-{tag}", f"{base}.2", f"{prefix[:-1]}B{tag}"[:15])
        self.hosts = (self.a, self.b)
        self.dir = ""
        self.shared = ""                     # a directory both hosts see
        self.agent = ""
        self.agent_log = ""
        self._made: List[str] = []

    # ------------------------------------------------------------------ set-up / teardown
    def create(self) -> "TwoHosts":
        # not under /tmp: host B has its own /tmp
        self.dir = tempfile.mkdtemp(prefix="hvd-netns-",
                                    dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.shared = os.path.join(self.dir, "shared")
        os.mkdir(self.shared)
        try:
            for h in self.hosts:
                _ip("netns", "add", h.ns)
                self._made.append(h.ns)
            _ip("link", "add", self.a.veth, "type", "veth", "peer", "name", self.b.veth)
            for h in self.hosts:
                # inside, both ends are IFNAME, like eth0 on two real machines
                _ip("link", "set", h.veth, "netns", h.ns)
                _ip("-n", h.ns, "link", "set", h.veth, "name", IFNAME)
                _address(h)
            self._write_agent()
        except BaseException:
            self.destroy()
            raise
        return self

    def _write_agent(self) -> None:
        """The ssh stand-in, which runs a command in the namespace of the host it names."""
        self.agent_log = os.path.join(self.dir, "agent.log")
        cases = "\n".join(f"  {h.ip}|{h.ns}) ns={h.ns} ;;" for h in self.hosts)
        self.agent = os.path.join(self.dir, "agent")
        with open(self.agent, "w") as fh:
            fh.write(AGENT.format(log=shlex.quote(self.agent_log), cases=cases,
                                  keep=shlex.quote(_checkout_under_tmp())))
        os.chmod(self.agent, 0o755)

    def pids(self) -> Dict[str, List[int]]:
        """Processes now running in each namespace."""
        return {h.ns: netns_pids(h.ns) for h in self.hosts}

    def leftovers(self, wait: float = 0.0, ignore: Sequence[int] = ()) -> List[str]:
        """Processes still in either namespace after up to ``wait`` s (none: ``[]``)."""
        deadline = time.monotonic() + wait
        while True:
            left = [p for pids in self.pids().values() for p in pids if p not in ignore]
            if not left or time.monotonic() >= deadline:
                return describe_pids(left)
            time.sleep(0.1)

    def destroy(self) -> List[str]:
        """Kill what runs in the namespaces, delete them (the veth pair goes with them) and
        the agent's directory. Returns the processes that were still running."""
        left: List[str] = []
        for ns in self._made:
            pids = netns_pids(ns)
            left += describe_pids(pids)
            for pid in pids:
                _kill(pid)
        deadline = time.monotonic() + 5
        while any(netns_pids(ns) for ns in self._made) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in self._made:
            _ip("netns", "delete", ns, check=False)
        self._made = []
        if self.a.veth and _link_exists(self.a.veth):   # made, not yet moved into a namespace
            _ip("link", "delete", self.a.veth, check=False)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left

    # ------------------------------------------------------------------ running things
    @property
    def hosts_arg(self) -> str:
        """``-H`` value with one slot per host."""
        return ",".join(f"{h.ip}:1" for h in self.hosts)

    def env(self, base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
        """Environment for a launcher on host A: PRRTE's ssh agent is ours."""
        env = dict(os.environ if base is None else base)
        env["PRTE_MCA_plm_ssh_agent"] = self.agent
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        env.update(extra)
        return env

    def wrap(self, argv: Sequence[str], host: Optional[NetnsHost] = None) -> List[str]:
        """``argv`` run in ``host``'s namespace (default A) under its hostname."""
        h = host or self.a
        return ["ip", "netns", "exec", h.ns, "unshare", "-u", "sh", "-c",
                'hostname "$0" && exec "$@"', h.ns, *argv]

    def run(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
            timeout: float = 30.0, host: Optional[NetnsHost] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` (default A) and wait; on timeout kill its session and
        raise AssertionError with what it printed."""
        proc = subprocess.Popen(self.wrap(argv, host), env=env if env is not None else self.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            for pids in self.pids().values():      # what it started on the hosts
                for pid in pids:
                    _kill(pid)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:     # a grandchild still holds the pipes
                proc.kill()
                out, err = "(output lost: the pipes stayed open)", ""
            raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s\n"
                                 f"stdout:\n{out}\nstderr:\n{err}\nagent:\n{self.agent_calls()}"
                                 ) from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def agent_calls(self) -> str:
        """What the agent was asked to run (for failure messages)."""
        try:
            with open(self.agent_log) as fh:
                return fh.read()[-4000:]
        except OSError:
            return "(the agent was not called)"


def _link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


class ManyHosts(TwoHosts):
    """``n`` hosts (2 to 8) on one switch: a bridge in a namespace of its own
    (``{prefix}S-{tag}``), each host joined to a port of it by a veth pair, as machines
    plugged into one switch. Hosts ``{prefix}A-{tag}``, ``{prefix}B-{tag}``, ... get .1, .2,
    ... of ``subnet``; the agent, :meth:`run`, :meth:`env` and :meth:`destroy` work as for
    :class:`TwoHosts`. :meth:`shape` limits every host's link, both directions, with ``tbf``.
    """

    def __init__(self, n: int, tag: Optional[str] = None, subnet: str = SUBNET,
                 prefix: str = "hvd") -> None:
        if not 2 <= n <= 8:
            raise ValueError(f"ManyHosts makes 2 to 8 hosts, not {n}")
        super().__init__(tag, subnet, prefix)
        tag = tag or str(os.getpid())
        base = subnet.split("/")[0].rsplit(".", 1)[0]
        # the veth pairs are made inside the namespaces: no name in the root namespace
        self.hosts = tuple(NetnsHost(f"{prefix}{letter}-{tag}", f"{base}.{i + 1}", "")
                           for i, letter in enumerate("ABCDEFGH"[:n]))
        self.a, self.b = self.hosts[0], self.hosts[1]
        self.switch = f"{prefix}S-{tag}"

    def create(self) -> "ManyHosts":
        self.dir = tempfile.mkdtemp(prefix="hvd-netns-",
                                    dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.shared = os.path.join(self.dir, "shared")
        os.mkdir(self.shared)
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                _ip("netns", "add", h.ns)
                self._made.append(h.ns)
                port = f"port{i}"
                _ip("link", "add", IFNAME, "netns", h.ns, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _address(h)
            self._write_agent()
        except BaseException:
            self.destroy()
            raise
        return self

    def shape(self, rate: str, burst: str = "128kb") -> None:
        """Every host's link limited to ``rate`` (tc's syntax, e.g. ``"1gbit"``) each way:
        ``tbf`` on the host's end (what it sends) and on its switch port (what it
        receives). Replaces an earlier shaping."""
        for i, h in enumerate(self.hosts):
            for ns, dev in ((h.ns, IFNAME), (self.switch, f"port{i}")):
                proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace",
                                       "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                                       "latency", "50ms"], capture_output=True, text=True,
                                      timeout=20)
                if proc.returncode != 0:
                    raise RuntimeError(f"tc tbf on {dev} in {ns} failed: {proc.stderr.strip()}")
