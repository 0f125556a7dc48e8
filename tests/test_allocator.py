"""The allocator tuning of the `rcdl` command (rcdl.app.allocator), in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = ("from rcdl.app.allocator import keep_freed_memory, allocator_setting; "
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
    from rcdl.app.rundir import environment_info

    assert environment_info()["malloc"] == "system default"  # main() and imports don't tune


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_python_m_rcdl_runs_through_the_tuned_entry():
    # run rcdl/__main__.py as `python -m rcdl --help` does, then ask how malloc was set up
    probe = ("import runpy, sys\n"
             "sys.argv = ['rcdl', '--help']\n"
             "try:\n    runpy.run_module('rcdl', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "from rcdl.app.allocator import allocator_setting\n"
             "print('SETTING', allocator_setting())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={**os.environ, "RCDL_MALLOC": ""})
    assert "reproduce" in out.stdout
    assert "SETTING glibc: no mmap" in out.stdout
