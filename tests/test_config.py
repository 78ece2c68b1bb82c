"""One place declares every environment variable (hvd_magic/config.py); docs show it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvd_magic import config

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\b(?:HOROVOD|HVD_MAGIC)_[A-Z0-9_]*[A-Z0-9]\b")


def _names_in_code():
    found = {}
    for path in (ROOT / "hvd_magic").rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "hvd_magic":
            continue
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, path.relative_to(ROOT).as_posix())
    return found


def test_every_variable_the_code_names_is_declared_and_vice_versa():
    in_code = _names_in_code()
    undeclared = {n: p for n, p in in_code.items() if n not in config.VARS}
    assert not undeclared, f"declare these in hvd_magic/config.py: {undeclared}"
    unused = sorted(set(config.VARS) - set(in_code))
    assert not unused, f"declared but read nowhere: {unused}"


def test_docs_show_the_table():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert config.markdown_table() in page, "regenerate docs/environment.md from config"


def test_values_are_typed_and_bad_ones_name_the_variable():
    assert config.get("HOROVOD_FUSION_THRESHOLD", {}) == 64 * 1024 * 1024
    assert config.get("HOROVOD_FUSION_THRESHOLD", {"HOROVOD_FUSION_THRESHOLD": " 0 "}) == 0
    assert config.get("HVD_MAGIC_NETNS", {"HVD_MAGIC_NETNS": "off"}) is False
    assert config.get("HOROVOD_CPU_OPERATIONS", {"HOROVOD_CPU_OPERATIONS": "GLOO"}) == "gloo"
    assert config.get("HVD_MAGIC_SWITCH_INTERVAL_MS", {"HVD_MAGIC_SWITCH_INTERVAL_MS": ""}) is None
    for name, bad, says in (("HVD_MAGIC_NETNS", "maybe", "use 1 or 0"),
                            ("HOROVOD_FUSION_THRESHOLD", "64MB", "use a whole number"),
                            ("HOROVOD_CYCLE_TIME", "fast", "use a number"),
                            ("HOROVOD_CPU_OPERATIONS", "nccl", "use one of mpi, gloo")):
        with pytest.raises(ValueError, match=f"{name}='{bad}': {says}"):
            config.get(name, {name: bad})


def test_the_code_reads_declared_variables_only_through_config():
    direct = re.compile(r"""environ\.get\(\s*["'](?:HOROVOD|HVD_MAGIC)_""")
    readers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "hvd_magic").rglob("*.py")
               if direct.search(p.read_text()) and p != ROOT / "hvd_magic" / "config.py"]
    assert not readers, f"read these through hvd_magic.config.get: {readers}"


def test_horovod_timeline_dynamic_writes_no_file_at_init(monkeypatch):
    """Horovod's test files set HOROVOD_TIMELINE=DYNAMIC: no file until start_timeline."""
    from hvd_magic.collectives.config import Config
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    assert Config.from_env().timeline == ""
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    assert Config.from_env().timeline == "/tmp/t.json"
