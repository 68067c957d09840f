"""Where runs keep what outlives them: Ray Train checkpoints, exports, uploaded files.

`TUNEYARD_STORAGE_PATH` is a folder every node mounts, or an object store URI
(`s3://bucket/prefix`, `gs://…`, any scheme pyarrow or an installed fsspec filesystem
opens). The service and the workers reach it the same way Ray Train does, through a
pyarrow filesystem, so an endpoint and credentials that work for one work for all: for S3
the standard AWS variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, …), which the service
passes on to every job.

A location inside storage is written the way users see it: a plain absolute path for a
folder, a URI for an object store. Ray reports paths without the scheme
(`bucket/prefix/…`); `location_of` turns them back into URIs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

# The standard variables object-store clients read; a job gets the service's own values
# of these whenever storage is an object store (contract/job_env.py keeps tuneyard's names).
CREDENTIAL_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CA_BUNDLE",
    "GOOGLE_APPLICATION_CREDENTIALS",
)


def is_uri(location: str) -> bool:
    return "://" in location


class StorageError(Exception):
    """Storage cannot be opened or read: a message that names the location and the cause."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    name: str  # relative to the folder listed, with "/" between parts
    size: int


class Storage:
    """One storage root and the locations under it."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") if is_uri(root) else os.path.abspath(root)
        self.remote = is_uri(root)

    def __repr__(self) -> str:
        return f"Storage({self.root!r})"

    @cached_property
    def _fs_and_base(self) -> tuple[Any, str]:
        return filesystem_for(self.root)

    @property
    def fs(self) -> Any:
        return self._fs_and_base[0]

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *(p.strip("/") for p in parts)])

    def contains(self, location: str) -> bool:
        inside = location == self.root or location.startswith(self.root + "/")
        return inside and "/../" not in f"{location}/"

    def fs_path(self, location: str) -> str:
        """The filesystem path of a location inside this storage (Ray's `Checkpoint.path`,
        with `fs` as its filesystem)."""
        return self._path(location)

    def _path(self, location: str) -> str:
        """The filesystem path of a location inside this storage."""
        if not self.contains(location):
            raise StorageError(f"{location!r} is not inside storage {self.root!r}")
        base = self._fs_and_base[1].rstrip("/")
        return base + location[len(self.root) :]

    def location_of(self, fs_path: str) -> str:
        """A path in this storage's filesystem (Ray's `Checkpoint.path`) as a location."""
        if not self.remote:
            return fs_path
        base = self._fs_and_base[1].rstrip("/")
        if fs_path != base and not fs_path.startswith(base + "/"):
            raise StorageError(f"{fs_path!r} is not inside storage {self.root!r}")
        return self.root + fs_path[len(base) :]

    # -- reading ---------------------------------------------------------------------

    def exists(self, location: str) -> bool:
        import pyarrow.fs as pafs

        info = self._call(location, self.fs.get_file_info, self._path(location))
        return bool(info.type != pafs.FileType.NotFound)

    def files(self, location: str) -> list[StoredFile]:
        """Every file under a folder, sorted by name; [] for a folder that is not there.

        Regular files only, reached without following a symbolic link: what a run wrote
        in its folder may link anywhere on this machine (pyarrow's listing follows links)."""
        import pyarrow.fs as pafs

        if not self.remote:
            return self._call(location, _regular_files, Path(self._path(location)))
        base = self._path(location).rstrip("/")
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        infos = self._call(location, self.fs.get_file_info, selector)
        return sorted(
            (
                StoredFile(info.path[len(base) + 1 :], int(info.size or 0))
                for info in infos
                if info.type == pafs.FileType.File
            ),
            key=lambda f: f.name,
        )

    def folders(self, location: str) -> list[str]:
        """The names of the folders right under a folder (none when it is not there)."""
        import pyarrow.fs as pafs

        base = self._path(location).rstrip("/")
        selector = pafs.FileSelector(base, recursive=False, allow_not_found=True)
        infos = self._call(location, self.fs.get_file_info, selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def read_chunks(self, location: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """A file's bytes; on a local folder, never a symbolic link's target."""
        if not self.remote:
            opened = self._call(location, _open_no_link, self._path(location))
            with opened:
                while chunk := opened.read(chunk_size):
                    yield chunk
            return
        stream = self._call(location, self.fs.open_input_stream, self._path(location))
        with stream:
            while chunk := stream.read(chunk_size):
                yield bytes(chunk)

    def read_bytes(self, location: str) -> bytes:
        return b"".join(self.read_chunks(location))

    def fetch(self, location: str, local: Path) -> Path:
        """A copy of a file or folder on this machine at `local` (the location itself when
        storage is a local folder: nothing is copied)."""
        if not self.remote:
            return Path(self._path(location))
        import pyarrow.fs as pafs

        info = self._call(location, self.fs.get_file_info, self._path(location))
        # copy_files makes the folders under a folder it copies, but not the folder itself.
        (local if info.type == pafs.FileType.Directory else local.parent).mkdir(
            parents=True, exist_ok=True
        )
        self._call(
            location,
            pafs.copy_files,
            self._path(location),
            str(local),
            source_filesystem=self.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        return local

    # -- writing ---------------------------------------------------------------------

    def put(self, local: Path, location: str) -> None:
        """Copy a local file or folder to `location`, replacing what was there."""
        import pyarrow.fs as pafs

        self.delete(location)
        target = self._path(location)
        if not self.remote:
            if local.is_dir():
                shutil.copytree(local, target)
            else:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(local, target)
            return
        self._call(
            location,
            pafs.copy_files,
            str(local),
            target,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
        )

    def move_in(self, local: Path, location: str) -> None:
        """Move a local file to `location`: a rename on a local folder, else an upload."""
        if not self.remote:
            target = Path(self._path(location))
            target.parent.mkdir(parents=True, exist_ok=True)
            local.rename(target)
            return
        self.put(local, location)
        local.unlink(missing_ok=True)

    def delete(self, location: str) -> None:
        """Remove a file or a folder and all under it; nothing there is not an error."""
        import pyarrow.fs as pafs

        path = self._path(location)
        info = self._call(location, self.fs.get_file_info, path)
        if info.type == pafs.FileType.Directory:
            self._call(location, self.fs.delete_dir, path)
        elif info.type == pafs.FileType.File:
            self._call(location, self.fs.delete_file, path)

    def check_reachable(self) -> None:
        """Raise StorageError, saying why, when the root cannot be listed."""
        import pyarrow.fs as pafs

        if not self.remote:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            return
        # The bucket must be there; the prefix under it is made by the first write.
        bucket = self._fs_and_base[1].split("/", 1)[0]
        info = self._call(self.root, self.fs.get_file_info, bucket)
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"storage {self.root!r}: the bucket {bucket!r} does not exist")

    def _call(self, location: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (OSError, ValueError) as exc:
            raise StorageError(f"storage {location!r}: {exc}") from exc


def _regular_files(folder: Path) -> list[StoredFile]:
    """The regular files under a local folder (not the folder itself a link), walked without
    following links; sorted by name."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    found = []
    pending = [""]
    while pending:
        relative = pending.pop()
        with os.scandir(folder / relative) as listing:
            for entry in listing:
                name = f"{relative}/{entry.name}" if relative else entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                elif entry.is_file(follow_symlinks=False):
                    found.append(StoredFile(name, entry.stat(follow_symlinks=False).st_size))
    return sorted(found, key=lambda f: f.name)


def _open_no_link(path: str) -> BinaryIO:
    """A local file opened for reading, refused (ELOOP) when it is a symbolic link: one put
    in place of a listed file after the listing."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


# Schemes pyarrow opens itself (pyarrow.fs.FileSystem.from_uri); others go through fsspec.
_ARROW_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "file", "abfs", "abfss"})


def scheme_problem(root: str) -> str | None:
    """Why no filesystem opens `root`'s scheme, or None. Opens no connection."""
    if not is_uri(root):
        return None
    scheme = root.split("://", 1)[0].lower()
    if scheme in _ARROW_SCHEMES:
        return None
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        return (
            f"no filesystem opens {scheme}:// URIs ({exc}); use a folder every node mounts, "
            "s3://, gs://, or install the fsspec package for the scheme"
        )
    return None


def filesystem_for(root: str) -> tuple[Any, str]:
    """The pyarrow filesystem and the path within it for a folder or URI: pyarrow's own
    filesystems first (as Ray Train picks them), else an fsspec filesystem wrapped for
    pyarrow."""
    import pyarrow
    import pyarrow.fs as pafs

    if not is_uri(root):
        return pafs.LocalFileSystem(), os.path.abspath(root)
    if problem := scheme_problem(root):
        raise StorageError(problem)
    uri = root
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if uri.lower().startswith("s3://") and region:
        # Without one pyarrow asks the network for the bucket's region first. The endpoint
        # and credentials come from the AWS variables, which pyarrow reads as the AWS
        # tools do.
        uri = f"{uri}?region={region}"
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, str(path)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError) as arrow_error:
        try:
            import fsspec

            spec_fs, path = fsspec.core.url_to_fs(root)
        except (ImportError, ValueError) as exc:
            scheme = root.split("://", 1)[0]
            raise StorageError(
                f"no filesystem opens {scheme}:// URIs ({arrow_error}; fsspec: {exc}); "
                "use a folder every node mounts, s3://, gs://, or install the fsspec "
                "package for the scheme"
            ) from exc
        return pafs.PyFileSystem(pafs.FSSpecHandler(spec_fs)), str(path)
