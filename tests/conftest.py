import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture
def one_rank():
    """The runtime on this process alone (no mpiexec), shut down afterwards unless it was
    already running (other tests expect it off)."""
    import hvd_magic.collectives as hvd
    was = hvd.is_initialized()
    hvd.init()
    yield
    if not was:
        hvd.shutdown()


@pytest.fixture(scope="module")
def two_hosts():
    """Two "hosts" (network namespaces joined by a veth pair, see netns_hosts.py); skips
    when they cannot be made here (not root, no `ip netns`). Everything still running in
    them afterwards is killed, and they are deleted, also when a test failed."""
    import netns_hosts
    why = netns_hosts.unusable_reason()
    if why:
        pytest.skip(why)
    netns_hosts.clean_stale()
    hosts = netns_hosts.TwoHosts().create()
    try:
        yield hosts
    finally:
        hosts.destroy()
