"""worker/training/jit_lock.py: a JIT build lock left by a killed builder no longer hangs a run.

The locks are real: torch's own FileBaton, taken by a real process in a temp
TORCH_EXTENSIONS_DIR, then killed or left running."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.training import jit_lock
from worker.training.jit_lock import JitBuildLockHeld, clear_stale_jit_locks

# Takes the op's build lock the way torch.utils.cpp_extension does, says so, and keeps it
# until its stdin closes; then releases it as a finished build does.
_BUILDER = textwrap.dedent(
    """
    import sys
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("building", flush=True)
    sys.stdin.read()
    baton.release()
    """
)


@pytest.fixture
def extensions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "torch_extensions"
    (root / "cpu_adam").mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


@pytest.fixture
def builder(extensions_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A process in the middle of building cpu_adam: it holds the op's lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(extensions_dir / "cpu_adam" / "lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "building"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_lock_left_by_a_killed_builder_is_cleared_with_a_log_line(
    extensions_dir: Path,
    builder: subprocess.Popen[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch.utils.file_baton import FileBaton

    lock = extensions_dir / "cpu_adam" / "lock"
    assert not jit_lock.on_network_filesystem(lock), "this node's own disk"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert lock.exists(), "a killed builder leaves its lock behind"

    with caplog.at_level(logging.INFO, logger="tuneyard.worker"):
        assert clear_stale_jit_locks() == [lock]
    assert not lock.exists()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"removed the stale JIT build lock {lock}" in line
    # What DeepSpeed's next load does: it takes the lock itself instead of waiting forever.
    assert FileBaton(str(lock)).try_acquire()


def test_a_build_under_way_is_waited_for_and_its_lock_left_to_it(
    extensions_dir: Path, builder: subprocess.Popen[str]
) -> None:
    lock = extensions_dir / "cpu_adam" / "lock"
    assert jit_lock.lock_holders(lock) == [builder.pid]
    assert builder.stdin is not None
    finish = threading.Timer(1.5, builder.stdin.close)  # the build ends a moment later
    finish.start()
    try:
        assert clear_stale_jit_locks(poll_s=0.1) == []
    finally:
        finish.cancel()
    assert not lock.exists()
    # The builder removed its own lock: nobody took it from under it.
    assert builder.wait(timeout=30) == 0


def test_a_build_stuck_past_the_bound_fails_naming_the_lock_and_what_to_do(
    extensions_dir: Path, builder: subprocess.Popen[str]
) -> None:
    lock = extensions_dir / "cpu_adam" / "lock"
    with pytest.raises(JitBuildLockHeld) as caught:
        clear_stale_jit_locks(stale_after_s=0.0)
    message = str(caught.value)
    assert f"the JIT build lock {lock} has been held by process {builder.pid}" in message
    assert f"delete {lock}" in message
    assert lock.exists()


def test_on_a_shared_filesystem_an_unheld_lock_is_cleared_only_once_it_is_stale(
    extensions_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another node may be building there, out of this node's sight."""
    monkeypatch.setattr(jit_lock, "on_network_filesystem", lambda path: True)
    lock = extensions_dir / "cpu_adam" / "lock"
    lock.touch()
    now = [lock.stat().st_mtime + 5.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    removed = clear_stale_jit_locks(
        stale_after_s=60.0, poll_s=10.0, clock=lambda: now[0], sleep=sleep
    )
    assert removed == [lock]
    assert sum(slept) == 60.0  # from 5 s old until past 60 s
    assert not lock.exists()


def test_torchs_default_root_and_its_python_and_device_folder_are_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert jit_lock.extensions_root() == tmp_path
    assert clear_stale_jit_locks() == [lock]


def test_no_extensions_folder_yet_is_nothing_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "absent"))
    assert clear_stale_jit_locks() == []


def test_every_rank_clears_the_locks_before_deepspeed_builds_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contract.run_request import RunRequest, RunSpec
    from worker.training import loop as train_loop

    class Cleared(Exception):
        pass

    def first(*args: object, **kwargs: object) -> None:
        raise Cleared

    monkeypatch.setattr(train_loop, "clear_stale_jit_locks", first)
    request = RunRequest.model_validate(
        {"model": "/models/m", "dataset": {"source": "/data/d.jsonl"}}
    )
    spec = RunSpec.for_attempt(
        request.worker_fields(), run_id="run_x", attempt=1, storage_path=str(tmp_path)
    )
    with pytest.raises(Cleared):
        train_loop.build_training(spec, rank=0)


@pytest.mark.parametrize(
    ("path", "shared"),
    [
        ("/home/ray/.cache/torch_extensions/cpu_adam/lock", True),
        ("/home/ray/local cache/cpu_adam/lock", False),
        ("/scratch/cpu_adam/lock", True),
        ("/tmp/cpu_adam/lock", False),
    ],
)
def test_locks_other_nodes_may_share_are_told_by_their_mount(
    tmp_path: Path, path: str, shared: bool
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "nas:/home /home nfs4 rw 0 0\n"
        "/dev/vdb /home/ray/local\\040cache ext4 rw 0 0\n"
        "s3fs /scratch fuse.s3fs rw 0 0\n"
        "tmpfs /tmp tmpfs rw 0 0\n"
    )
    assert jit_lock.on_network_filesystem(Path(path), mounts_file=mounts) is shared
