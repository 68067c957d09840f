"""A model or dataset the run reads from object storage (an uploaded file, an earlier run's
export), copied once per node to local disk, where transformers and datasets read it.

Every rank of a node asks; the first takes a lock and copies into a temporary folder
renamed into place when complete, the others wait on the lock and find the copy. A copy
left half-done by a killed worker is never used: only a finished copy has the final name.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from contract.run_request import RunSpec
from contract.storage import Storage, is_uri

log = logging.getLogger("tuneyard.worker")


def cache_root() -> Path:
    return Path(os.environ.get("TUNEYARD_SOURCE_CACHE", tempfile.gettempdir())) / (
        "tuneyard-sources"
    )


def local_copy(location: str, *, root: Path | None = None) -> str:
    """`location` itself when it is a local path or hub id; for a URI, the path of this
    node's copy of the file or folder."""
    if not is_uri(location):
        return location
    root = root or cache_root()
    key = hashlib.sha256(location.encode()).hexdigest()[:20]
    folder = root / key
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (location.rstrip("/").rsplit("/", 1)[-1] or "source")
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.exists():
            partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder))
            try:
                Storage(location).fetch(location, partial / target.name)
                os.rename(partial / target.name, target)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            log.info("copied %s to %s", location, target)
    return str(target)


def with_local_sources(spec: RunSpec) -> RunSpec:
    """The spec with its model and dataset sources on this node's disk."""
    dataset = spec.dataset
    sources = {
        key: local_copy(value)
        for key in ("source", "eval_source")
        if (value := getattr(dataset, key)) is not None and is_uri(value)
    }
    if not sources and not is_uri(spec.model):
        return spec
    return spec.model_copy(
        update={
            "model": local_copy(spec.model),
            "model_name": spec.given_model,
            "dataset": dataset.model_copy(update=sources),
        }
    )
