"""Service settings: one place, read from the environment (prefix ``TUNEYARD_``)."""

from __future__ import annotations

import ipaddress
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The demo writes its tiny model and dataset here, so runs may read from it by default.
DEMO_DIRNAME = "demo"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEYARD_", extra="ignore")

    # Root of every embedded default: database, storage, the local Ray head's state.
    home: Path = Path("./.tuneyard")
    # Unset → SQLite (WAL) under `home`, so a fresh machine needs no database server.
    database_url: str | None = None
    # Ray Train storage_path, uploads and exports. Must be shared storage on a real cluster.
    storage_path: Path | None = None
    # Unset → `serve` starts a local Ray head bound to 127.0.0.1 and stops it on exit.
    ray_address: str | None = None
    # Colon-separated folders a run may read a local model or dataset from.
    allowed_roots: str | None = None
    # The address workers on the cluster use to reach this service; unset → host:port.
    callback_url: str | None = None
    auth: Literal["apikey", "disabled"] = "apikey"
    # Uploads beyond this are refused with 413 while streaming, before they fill the disk.
    max_upload_bytes: int = Field(default=1 << 30, gt=0)

    host: str = "127.0.0.1"
    port: int = 8000
    # HTTP worker processes of `serve`. One process is bound to one core by the GIL; with
    # many pollers give it one per core. Each runs a dispatcher too (claims are
    # compare-and-set, so they never double-submit).
    workers: int = Field(default=1, ge=1)

    # A database still starting (a fresh container) gets this long to answer at start-up.
    database_wait_s: float = Field(default=60.0, ge=0)

    # Runs live on Ray at once; the rest wait in the queue, oldest first.
    max_concurrent_runs: int = Field(default=4, ge=1)
    # How often the dispatcher looks for queued runs and checks Ray's view of live ones.
    dispatch_interval_s: float = Field(default=1.0, gt=0)
    # CPUs the embedded Ray head advertises; unset → Ray counts the machine's cores.
    local_ray_num_cpus: int | None = Field(default=None, ge=1)

    # `json` for log shippers (one object per line); `text` for a terminal. Both carry the
    # run id of every record that concerns a run.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("storage_path", mode="before")
    @classmethod
    def _refuse_uris(cls, value: object) -> object:
        # Path("s3://bucket") would silently become the local folder "s3:/bucket".
        if isinstance(value, str) and "://" in value:
            raise ValueError(
                f"TUNEYARD_STORAGE_PATH must be a filesystem path every node shares, got "
                f"{value!r}; object-store URIs are not supported yet: mount the bucket on "
                f"every node (e.g. mountpoint-s3, gcsfuse) and give the mount path"
            )
        return value

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        if self.auth == "disabled" and not _is_loopback(self.host):
            raise ValueError(
                f"TUNEYARD_AUTH=disabled is only allowed when bound to a loopback address, "
                f"but host is {self.host!r}"
            )
        return self

    @cached_property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home_dir / 'tuneyard.db'}"

    @property
    def resolved_storage_path(self) -> Path:
        return (self.storage_path or self.home_dir / "storage").expanduser().resolve()

    @property
    def resolved_allowed_roots(self) -> list[Path]:
        if self.allowed_roots:
            roots = [Path(p) for p in self.allowed_roots.split(":") if p]
        else:
            roots = [self.home_dir, self.home_dir / DEMO_DIRNAME]
        return [r.expanduser().resolve() for r in roots]

    @property
    def resolved_callback_url(self) -> str:
        if self.callback_url:
            return self.callback_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def ray_state_dir(self) -> Path:
        """Where the embedded Ray head keeps its address and auth token."""
        return self.home_dir / "ray"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
