"""The allocator tuning of the `rcdl` command (rcdl.allocator), in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = ("from rcdl.allocator import keep_freed_memory, allocator_setting; "
         "print(keep_freed_memory()); print(allocator_setting())")


def _probe(**env):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    tuned, setting = out.stdout.splitlines()
    return tuned == "True", setting


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_malloc_is_tuned_and_says_so():
    tuned, setting = _probe(RCDL_MALLOC="")
    assert tuned and setting.startswith("glibc: no mmap")


def test_rcdl_malloc_system_opts_out():
    tuned, setting = _probe(RCDL_MALLOC="system")
    assert not tuned and "RCDL_MALLOC=system" in setting


def test_the_library_alone_leaves_malloc_alone():
    from rcdl.rundir import environment_info

    assert environment_info()["malloc"] == "system default"  # main() and imports don't tune


def test_python_m_rcdl_runs_through_the_tuned_entry():
    out = subprocess.run([sys.executable, "-m", "rcdl", "--help"], capture_output=True,
                         text=True, check=True)
    assert "reproduce" in out.stdout
