"""Whether the embedded Ray head is alive, as a process reviving it judges."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cluster.ray_head import _alive

# Stands for `serve --workers N`'s parent: it starts a child (the head) that ends and is never
# reaped, so it stays a zombie of a process that is not the one asking.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "pass"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads procfs")
def test_a_head_dead_as_another_processs_zombie_is_not_alive() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        head = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while "Z" not in Path(f"/proc/{head}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.1)
        assert not _alive(head)
        assert _alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()


def test_a_head_that_is_our_own_ended_child_is_reaped_and_not_alive() -> None:
    head = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while _alive(head.pid):
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.1)
