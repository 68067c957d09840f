"""torch's JIT build locks, which DeepSpeed's ops (shared-memory comm, CPU Adam) build under:
one a killed worker left behind is cleared before it can hang the next run.

`torch.utils.cpp_extension` builds an op under a `FileBaton`: it creates
`<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/pyXY_cpu>/<op>/lock` with O_EXCL,
builds, and removes it; any other process that finds the file polls until it is gone, with
no time limit. A worker killed mid-build (Ray stopping the job, a failed health check, the
OOM killer) leaves the file behind, and every later run on that node waits forever in its
first DeepSpeed call. The file records no owner, but the builder holds it open for the whole
build, so a lock that no process holds open has lost its builder.

A lock on a network filesystem may belong to a build on another node, which this node
cannot see: that one is cleared only once it is older than any build takes
(STALE_AFTER_S, as .ci/run does). A lock a live process on this node holds is a build
under way: it is waited for, up to the same bound, and then this rank fails with an error
that names the lock and its holder rather than hang.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tuneyard.worker")

# Builds take seconds to a few minutes (cpu_adam about 30 s on 2 cores); .ci/run uses 10.
STALE_AFTER_S = 600.0
POLL_S = 1.0
# FileBaton.release closes its file before removing it: two looks this far apart that both
# find no holder cannot both fall in that gap.
CONFIRM_S = 0.5
# Mount points in /proc/self/mounts escape spaces and the like as octal (\040).
_OCTAL = re.compile(r"\\([0-7]{3})")
_NETWORK_FS = ("nfs", "cifs", "smb", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p")


class JitBuildLockHeld(RuntimeError):
    """A live process has held a build lock for longer than any build takes."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions, as `torch.utils.cpp_extension` chooses it."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    """The build locks under `root`: `<root>/<op>/lock`, and one level deeper for torch's
    default root, which adds a `pyXY_cpu`-style folder."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def clear_stale_jit_locks(
    root: Path | None = None,
    *,
    stale_after_s: float = STALE_AFTER_S,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Path]:
    """Clear every build lock whose builder is gone; wait (bounded) for the ones a build
    holds. Returns the locks it removed. Call it before DeepSpeed builds or loads an op."""
    root = root if root is not None else extensions_root()
    if not root.is_dir():
        return []
    removed = []
    for lock in build_locks(root):
        if _settle(lock, stale_after_s=stale_after_s, poll_s=poll_s, clock=clock, sleep=sleep):
            removed.append(lock)
    return removed


def _settle(
    lock: Path,
    *,
    stale_after_s: float,
    poll_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    """Wait until `lock` is gone or clear it; True when this process removed it."""
    shared = on_network_filesystem(lock)
    said = ""
    while True:
        try:
            born = lock.stat().st_mtime  # FileBaton never writes to it: its creation time
        except FileNotFoundError:
            return False  # the build finished
        age = clock() - born
        holders = lock_holders(lock)
        if holders:
            if age > stale_after_s:
                raise JitBuildLockHeld(
                    f"the JIT build lock {lock} has been held by process "
                    f"{', '.join(map(str, holders))} for {age:.0f} s, longer than any build "
                    f"takes: that build is stuck. Stop the process, delete {lock}, and start "
                    "the run again (resume it)."
                )
            news = f"waiting for the JIT build under way in process {holders} (lock {lock})"
        elif not shared or age > stale_after_s:
            return _remove_if_abandoned(lock, age=age)
        else:
            news = (
                f"waiting for the JIT build lock {lock} on a shared filesystem: a build on "
                f"another node, or left by a killed one; cleared at {stale_after_s:.0f} s old"
            )
        if news != said:
            log.info("%s", news)
            said = news
        sleep(poll_s)


def _remove_if_abandoned(lock: Path, *, age: float) -> bool:
    """Remove `lock` if it is still the same file and still nobody holds it. Ranks on one
    node may do this at once: one at a time, each looking again under a side lock (which
    stays: removing it would let two ranks hold two different files)."""
    with open(lock.with_name("lock.tuneyard-check"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when the file closes
        try:
            first = lock.stat()
            time.sleep(CONFIRM_S)
            again = lock.stat()
            if lock_holders(lock) or (again.st_ino, again.st_mtime_ns) != (
                first.st_ino,
                first.st_mtime_ns,
            ):
                return False  # a new build took it meanwhile
            lock.unlink()
        except FileNotFoundError:
            return False  # released, or a peer rank removed it
    log.warning(
        "removed the stale JIT build lock %s (%.0f s old, no process holds it): a worker "
        "was killed while building a DeepSpeed op; this rank builds it again",
        lock,
        age,
    )
    return True


def lock_holders(lock: Path) -> list[int]:
    """The processes on this node, other than this one, that hold `lock` open (a build under
    way). Processes of other users cannot be inspected and are not counted: their builds
    use their own extensions folder."""
    target = os.path.realpath(lock)
    holders = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        holders.append(int(proc.name))
                        break
    return holders


def on_network_filesystem(path: Path, *, mounts_file: Path = Path("/proc/self/mounts")) -> bool:
    """Whether `path` lies on a filesystem other nodes may share (NFS, Lustre, FUSE...), by
    the longest mount point above it. Unknown counts as shared: waiting is the safe side."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        mounts = mounts_file.read_text().splitlines()
    except OSError:
        return True
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, fstype = point, fields[2]
    return not fstype or fstype.startswith(("fuse", *_NETWORK_FS))
