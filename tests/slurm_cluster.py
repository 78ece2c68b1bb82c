"""A real Slurm on this machine for tests: two nodes in network namespaces, made and removed
by the test itself.

:class:`SlurmCluster` starts ``munged`` (its own socket and key copy, as the ``munge`` user),
makes two network namespaces ``hvsl1-<pid>`` / ``hvsl2-<pid>`` joined by a veth pair on
10.232.0.0/24 (the multi-host tests use 10.231.0.0/24), and runs ``slurmctld`` and one
``slurmd`` per namespace, each node under its own hostname (a private UTS namespace). The
nodes are ``sn<pid>-1`` and ``sn<pid>-2`` (Slurm writes them as ``sn<pid>-[1-2]``).
Namespaces are entered with ``nsenter`` (``ip netns exec`` remounts /sys, and slurmd then
fails; ../shared/FACTS.md). Everything goes under one directory named by ``SLURM_CONF``;
Slurm's clients need that variable (without a config they look for a DNS SRV record).

:meth:`SlurmCluster.on_node` wraps a command to run on a node as a login shell there would:
its network, its hostname, ``SLURM_CONF`` set; the tests start the notebook's kernel side,
``salloc``, ``squeue`` and ``hvdrun`` on node 1. :meth:`SlurmCluster.destroy` cancels every
job, stops the daemons, kills whatever still runs in the namespaces and deletes them, also
after a failure.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import netns_hosts

SUBNET = "10.232.0.0/24"
DAEMONS = ("slurmctld", "slurmd", "munged", "munge", "salloc", "scancel", "squeue")

CONF = """\
ClusterName=hvd{tag}
SlurmctldHost={n1}({ip1})
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
ReturnToService=1
SlurmdTimeout=30
MinJobAge=2
KillWait=2
InactiveLimit=0
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
NodeName={n1} NodeAddr={ip1} CPUs=2 State=UNKNOWN
NodeName={n2} NodeAddr={ip2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def unusable_reason() -> Optional[str]:
    """Why a test Slurm cannot run here (None when it can)."""
    why = netns_hosts.unusable_reason()
    if why:
        return why
    for tool in ("slurmctld", "slurmd", "salloc", "squeue", "scancel", "scontrol", "munged",
                 "nsenter", "runuser"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return (f"the Slurm tests need `{tool}`: apt-get install --no-install-recommends "
                    "slurmctld slurmd slurm-client munge (make setup does)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the Slurm tests need the `munge` user (apt-get install munge)"
    if not os.path.exists("/etc/munge/munge.key"):
        return "the Slurm tests need /etc/munge/munge.key (apt-get install munge makes it)"
    return None


def _sbin(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


class SlurmCluster:
    """Two Slurm nodes in network namespaces; see the module docstring."""

    def __init__(self, tag: Optional[str] = None) -> None:
        self.tag = tag or str(os.getpid())
        self.nodes = [f"sn{self.tag}-1", f"sn{self.tag}-2"]
        self.ips = ["10.232.0.1", "10.232.0.2"]
        self.ns = [f"hvsl1-{self.tag}", f"hvsl2-{self.tag}"]
        self.veth = [f"hvs1{self.tag}"[:15], f"hvs2{self.tag}"[:15]]
        self.dir = ""
        self.conf = ""
        self.procs: Dict[str, subprocess.Popen] = {}
        self._made: List[str] = []

    # ------------------------------------------------------------------ set-up
    def create(self, timeout: float = 20.0) -> "SlurmCluster":
        # not under /tmp: short paths, and away from what other tests clean
        self.dir = tempfile.mkdtemp(prefix="hvsl-", dir="/var/tmp")
        os.chmod(self.dir, 0o755)
        try:
            self._munge()
            self._network()
            self.conf = os.path.join(self.dir, "slurm.conf")
            with open(self.conf, "w") as fh:
                fh.write(CONF.format(tag=self.tag, n1=self.nodes[0], n2=self.nodes[1],
                                     ip1=self.ips[0], ip2=self.ips[1], dir=self.dir,
                                     munge_socket=self.munge_socket))
            os.makedirs(os.path.join(self.dir, "state"))
            self._daemon("slurmctld", 0, [_sbin("slurmctld"), "-D", "-i"])
            for i, node in enumerate(self.nodes):
                self._daemon(f"slurmd{i + 1}", i, [_sbin("slurmd"), "-D", "-N", node],
                             hostname=node)
            self.wait_idle(timeout)
        except BaseException:
            self.destroy()
            raise
        return self

    def _munge(self) -> None:
        mdir = os.path.join(self.dir, "munge")
        kdir = os.path.join(self.dir, "munge-key")
        user = pwd.getpwnam("munge")
        for d, mode in ((mdir, 0o755), (kdir, 0o700)):
            os.mkdir(d)
            os.chown(d, user.pw_uid, user.pw_gid)
            os.chmod(d, mode)
        key = os.path.join(kdir, "key")
        shutil.copyfile("/etc/munge/munge.key", key)
        os.chown(key, user.pw_uid, user.pw_gid)
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(mdir, "sock")
        argv = ["runuser", "-u", "munge", "--", _sbin("munged"), "-F",
                f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={kdir}/pid", f"--log-file={kdir}/log",
                f"--seed-file={kdir}/seed"]
        self.procs["munged"] = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL,
                                                start_new_session=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(kdir + '/log')}")
            time.sleep(0.05)

    def _network(self) -> None:
        for ns in self.ns:
            netns_hosts._ip("netns", "add", ns)
            self._made.append(ns)
        netns_hosts._ip("link", "add", self.veth[0], "type", "veth", "peer", "name",
                        self.veth[1])
        for ns, veth, ip in zip(self.ns, self.veth, self.ips):
            netns_hosts._ip("link", "set", veth, "netns", ns)
            netns_hosts._ip("-n", ns, "link", "set", veth, "name", "eth0")
            netns_hosts._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            netns_hosts._ip("-n", ns, "link", "set", "eth0", "up")
            netns_hosts._ip("-n", ns, "link", "set", "lo", "up")

    def _daemon(self, name: str, node: int, argv: Sequence[str],
                hostname: Optional[str] = None) -> None:
        host = hostname or self.nodes[node]
        wrapped = ["nsenter", f"--net=/run/netns/{self.ns[node]}", "unshare", "-u", "sh", "-c",
                   'hostname "$0" && exec "$@"', host, *argv]
        log = open(os.path.join(self.dir, f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen(wrapped, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=self.dir)
        log.close()

    def env(self, base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
        """An environment for Slurm's clients and anything started on a node."""
        env = dict(os.environ if base is None else base)
        for k in list(env):
            if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_")):
                del env[k]
        env["SLURM_CONF"] = self.conf
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        env.update(extra)
        return env

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): "
                                       f"{self._tail(os.path.join(self.dir, name + '.out'))}")
            proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10, check=False)
            out = proc.stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm nodes did not become idle in {timeout} s: {out!r}\n"
                           f"{self.logs()}")

    # ------------------------------------------------------------------ running things
    def uts(self, node: int) -> str:
        """The UTS namespace of node ``node`` (its slurmd's): its hostname."""
        return f"/proc/{self.procs[f'slurmd{node + 1}'].pid}/ns/uts"

    def on_node(self, argv: Sequence[str], node: int = 0) -> List[str]:
        """``argv`` run on node ``node`` (its network and hostname)."""
        return ["nsenter", f"--net=/run/netns/{self.ns[node]}", f"--uts={self.uts(node)}",
                *argv]

    def run(self, argv: Sequence[str], node: int = 0, timeout: float = 30.0,
            env: Optional[Dict[str, str]] = None, check: bool = True,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on a node and wait; on timeout kill it and raise AssertionError."""
        proc = subprocess.Popen(self.on_node(argv, node), env=env or self.env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            out, err = proc.communicate(timeout=10)
            raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s\n"
                                 f"stdout:\n{out}\nstderr:\n{err}\n{self.logs()}") from None
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}\nstdout:\n{out}\n"
                                 f"stderr:\n{err}")
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def jobs(self) -> List[str]:
        """``squeue``'s lines: ``JOBID STATE NODES`` of the jobs Slurm still lists."""
        out = self.run(["squeue", "-h", "-o", "%i %T %N"], check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def wait_no_jobs(self, timeout: float = 10.0) -> List[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = self.jobs()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def set_state(self, node: int, state: str, reason: str = "test") -> None:
        argv = ["scontrol", "update", f"nodename={self.nodes[node]}", f"state={state}"]
        if state.lower() in ("down", "drain"):
            argv.append(f"reason={reason}")
        self.run(argv)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", f"slurmd-{self.nodes[0]}.log",
                     f"slurmd-{self.nodes[1]}.log"):
            parts.append(f"--- {name}\n{self._tail(os.path.join(self.dir, name))}")
        return "\n".join(parts)

    @staticmethod
    def _tail(path: str, n: int = 3000) -> str:
        try:
            with open(path, errors="replace") as fh:
                return fh.read()[-n:]
        except OSError:
            return "(none)"

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> List[str]:
        """Cancel the jobs, stop the daemons, empty and delete the namespaces; returns what
        still ran in the namespaces besides the daemons."""
        if self.conf and "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(self.on_node(["scancel", "--full", "-u", "root"]), env=self.env(),
                           capture_output=True, timeout=15)
        daemons = {p.pid for p in self.procs.values()}
        left: List[str] = []
        for ns in self._made:
            pids = netns_hosts.netns_pids(ns)
            left += [d for d in netns_hosts.describe_pids([p for p in pids if p not in daemons])]
            for pid in pids:
                netns_hosts._kill(pid)
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while any(netns_hosts.netns_pids(ns) for ns in self._made) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in self._made:
            netns_hosts._ip("netns", "delete", ns, check=False)
        self._made = []
        if netns_hosts._link_exists(self.veth[0]):
            netns_hosts._ip("link", "delete", self.veth[0], check=False)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left


def clean_stale() -> List[str]:
    """Namespaces earlier runs left behind (their pid is gone): emptied and deleted."""
    return netns_hosts.clean_stale(("hvsl1-", "hvsl2-"))
