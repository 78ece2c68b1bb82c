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
