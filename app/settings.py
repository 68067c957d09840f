"""Service settings: one place, read from the environment (prefix ``TUNEYARD_``)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.services.rules.path_rules import ServiceFolder, SourceRoots
from app.services.rules.run_rules import RequestPolicy
from app.services.rules.tracking_rules import TrackingConfig
from app.services.rules.webhook_addresses import AddressPolicy
from app.services.rules.webhook_rules import WebhookConfig
from contract.graders import sandbox
from contract.job_env import PLACEMENT_TIMEOUT_ENV, RESERVED_NAMES, RESERVED_PREFIX
from contract.run_request import TERMINAL_WEBHOOK_EVENTS, WEBHOOK_EVENTS, WebhookSpec
from contract.storage import CREDENTIAL_VARIABLES, Storage, is_uri, scheme_problem

# The demo writes its tiny model and dataset here, so runs may read from it by default.
DEMO_DIRNAME = "demo"
# Uploaded files, under the storage path. Reachable only through their file id, by their owner.
UPLOADS_DIRNAME = "files"


class Settings(BaseSettings):
    # Errors name the setting, never its value: job_env and database_url may hold secrets.
    model_config = SettingsConfigDict(
        env_prefix="TUNEYARD_", extra="ignore", hide_input_in_errors=True
    )

    # Root of every embedded default: database, storage, the local Ray head's state.
    home: Path = Path("./.tuneyard")
    # Unset → SQLite (WAL) under `home`, so a fresh machine needs no database server.
    database_url: str | None = None
    # Ray Train storage_path, uploads and exports: a folder every node of the cluster
    # mounts, or an object store URI (s3://bucket/prefix, gs://…; contract/storage.py).
    storage_path: str | None = None
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

    # Runs live on Ray at once, at most; the rest wait in the queue, which the scheduler
    # orders by priority, fair share between API keys and age (app/services/scheduling.py),
    # and from which it starts only what the cluster can place now.
    max_concurrent_runs: int = Field(default=4, ge=1)
    # Preemption: a queued run that cannot be placed may stop a running one of lower
    # priority that asked to be preemptible. That run checkpoints at its current step and
    # goes back to the queue; it is never stopped before its attempt has run
    # `preemption_min_run_s` (no thrashing), and if it has not stopped
    # `preemption_grace_s` after the request (a huge checkpoint, a stuck worker), its job is
    # stopped and it resumes from its latest checkpoint. The worker asks whether to stop
    # every `preemption_poll_s`.
    preemption: bool = True
    preemption_min_run_s: float = Field(default=600.0, ge=0)
    preemption_grace_s: float = Field(default=900.0, gt=0)
    preemption_poll_s: float = Field(default=5.0, gt=0)
    # Placement. False: the nodes the cluster has now are all it will have, so a run they
    # can never hold (a GPU run without GPU nodes) is refused at validation. True (an
    # autoscaling cluster): such a run is accepted and waits for nodes to be added.
    cluster_autoscales: bool = False
    # How long a started run's workers may wait to be placed (busy resources, nodes being
    # added) before the run fails; Ray Train's own default retries that wait forever.
    placement_timeout_s: float = Field(default=600.0, gt=0)
    # A queued run no node of a cluster that does not autoscale can ever hold (a GPU run on
    # CPU nodes, a node lost) says so at once and fails after this long: a minute lets a
    # node that restarts, or rejoins a restarted head, come back; longer only keeps users
    # waiting on a run that will never start.
    unplaceable_grace_s: float = Field(default=60.0, gt=0)
    # Environment of every job, on top of what tuneyard sets: JSON, e.g.
    # {"NCCL_SOCKET_IFNAME": "eth0"}. Values are never logged (they may be secrets).
    job_env: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # The service's own variables forwarded to every job: comma-separated names or PREFIX_*
    # globs, e.g. "HF_TOKEN,NCCL_*", so secrets stay in the service's environment only.
    job_env_passthrough: str = ""
    # How often the dispatcher looks for queued runs and checks Ray's view of live ones.
    dispatch_interval_s: float = Field(default=1.0, gt=0)
    # CPUs the embedded Ray head advertises; unset → Ray counts the machine's cores.
    local_ray_num_cpus: int | None = Field(default=None, ge=1)

    # `json` for log shippers (one object per line); `text` for a terminal. Both carry the
    # run id of every record that concerns a run.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # Webhooks (app/services/webhooks.py). Every delivery is signed with this secret
    # (header Tuneyard-Signature); without it no run may ask for webhooks.
    webhook_secret: SecretStr | None = None
    # Service-wide subscribers, comma-separated http(s) URLs, told of every run's
    # `webhook_events` (comma-separated; default: the terminal ones). They need the secret.
    webhook_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_events: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list[str](TERMINAL_WEBHOOK_EVENTS)
    )
    # A run's webhooks go to public addresses only, checked again on every connection (a
    # tenant's URL would otherwise reach the service's own network: app/services/
    # webhook_addresses.py). Private receivers they may reach too, comma-separated: networks
    # or addresses (10.20.0.0/16, 127.0.0.1, fd12::/16) and host names (a name listed may
    # resolve to any address). Cloud metadata addresses stay refused whatever this says.
    webhook_allowed_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A delivery is retried with exponential backoff and jitter from this base (5 s, 10 s,
    # 20 s ...: about 10 minutes over 8 attempts), then given up as failed.
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_retry_base_s: float = Field(default=5.0, gt=0)
    # Short, so that a slow receiver holds a delivery thread for seconds, not minutes.
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    # How often the deliverer looks for deliveries that are due.
    webhook_poll_interval_s: float = Field(default=1.0, gt=0)

    # `POST /v1/runs/validate` with `profile: true` (app/services/profiles.py). The price of
    # one GPU-hour: unset, a profile reports no cost; a CPU-only run costs 0 at any price.
    gpu_hour_price: float | None = Field(default=None, ge=0)
    # The currency `gpu_hour_price` is in, reported beside the cost (an ISO 4217 code).
    gpu_hour_currency: str = Field(default="USD", min_length=1, max_length=8)
    # A profile's Ray job is stopped past this: loading a large model and a first step that
    # JIT-builds DeepSpeed's ops can take minutes, but the request must end.
    profile_timeout_s: float = Field(default=900.0, gt=0)
    # Profiles this process runs at once, all keys together (each key runs one at a time).
    # A profile is a run-sized Ray job that starts at once, past the queue and its
    # max_concurrent_runs: a few at most, so that profiling cannot crowd out the runs.
    max_concurrent_profiles: int = Field(default=2, ge=1)

    # Python graders (contract/graders/sandbox.py) run the code of whoever holds a key: off
    # unless the operator turns them on, and then only in bubblewrap's sandbox (`bwrap`
    # must be installed; the service refuses to start without it), with OpenAI's limits.
    python_graders: bool = False
    # Python graders that `graders/run` runs at once, all keys together; past it a 429.
    # Each may hold a thread and a CPU for up to its 2-minute limit.
    max_concurrent_python_graders: int = Field(default=2, ge=1)

    # Experiment tracking (worker/reporting/tracking.py). The MLflow tracking server that runs
    # asking for `tracking.mlflow` log to, as the cluster's nodes reach it; unset, no run may ask. A
    # job gets it as MLFLOW_TRACKING_URI. W&B needs no setting: WANDB_API_KEY and WANDB_BASE_URL go
    # from the service's environment to the runs that ask for W&B.
    mlflow_tracking_uri: str | None = None

    @field_validator("storage_path", mode="before")
    @classmethod
    def _storage_opens(cls, value: object) -> object:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, str) and is_uri(value):
            if "?" in value:
                # Options in the URI would end up inside every path joined to it.
                raise ValueError(
                    "TUNEYARD_STORAGE_PATH: give the object store's endpoint and credentials "
                    "in the AWS_* variables (AWS_ENDPOINT_URL, ...), not as URI options"
                )
            if problem := scheme_problem(value):
                raise ValueError(f"TUNEYARD_STORAGE_PATH: {problem}")
        return value

    @field_validator("job_env", mode="before")
    @classmethod
    def _job_env_from_json(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            parsed = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            # The value may hold a secret: name the problem, never echo the text.
            raise ValueError(
                f'TUNEYARD_JOB_ENV must be a JSON object such as {{"NCCL_SOCKET_IFNAME": '
                f'"eth0"}}: {exc.msg} at character {exc.pos}'
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError("TUNEYARD_JOB_ENV must be a JSON object of names to values")
        for name, item in parsed.items():
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                raise ValueError(f"TUNEYARD_JOB_ENV: the value of {name!r} must be a string")
        return {name: str(item) for name, item in parsed.items()}

    @field_validator("job_env")
    @classmethod
    def _refuse_owned_job_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if problem := _job_variable_problem(name, glob=False):
                raise ValueError(f"TUNEYARD_JOB_ENV may not set {name!r}: {problem}")
        return value

    @field_validator("job_env_passthrough")
    @classmethod
    def _refuse_owned_passthrough(cls, value: str) -> str:
        for pattern in _split_names(value):
            if problem := _job_variable_problem(pattern, glob=True):
                raise ValueError(
                    f"TUNEYARD_JOB_ENV_PASSTHROUGH may not name {pattern!r}: {problem}"
                )
        return value

    @field_validator("webhook_urls", "webhook_events", "webhook_allowed_networks", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return _split_names(value)
        return value

    @field_validator("webhook_urls")
    @classmethod
    def _webhook_urls_are_http(cls, value: list[str]) -> list[str]:
        # The URL rule runs' webhooks meet (httpx parses it, no credentials in it); not the
        # address rule: the operator chose these receivers, on their own network maybe.
        for url in value:
            try:
                WebhookSpec(url=url)
            except ValidationError:
                # Only the rule: a URL may carry a token in its query.
                raise ValueError(
                    "TUNEYARD_WEBHOOK_URLS must be comma-separated http:// or https:// URLs, "
                    "each one httpx can send to, without credentials (user:password@)"
                ) from None
        return value

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _allowed_networks_parse(cls, value: list[str]) -> list[str]:
        try:
            AddressPolicy.parse(value)
        except ValueError as exc:
            raise ValueError(f"TUNEYARD_WEBHOOK_ALLOWED_NETWORKS: {exc}") from None
        return value

    @field_validator("webhook_events")
    @classmethod
    def _webhook_events_are_known(cls, value: list[str]) -> list[str]:
        unknown = [event for event in value if event not in WEBHOOK_EVENTS]
        if unknown or not value:
            raise ValueError(
                f"TUNEYARD_WEBHOOK_EVENTS: {', '.join(unknown) or 'none given'}; "
                f"choose from {', '.join(WEBHOOK_EVENTS)}"
            )
        return value

    @model_validator(mode="after")
    def _webhooks_are_signed(self) -> Settings:
        if self.webhook_urls and self.webhook_secret is None:
            raise ValueError(
                "TUNEYARD_WEBHOOK_URLS needs TUNEYARD_WEBHOOK_SECRET: every delivery is signed "
                "with it, so that receivers can tell tuneyard's from anyone's"
            )
        if self.webhook_secret is not None and len(self.webhook_secret.get_secret_value()) < 16:
            raise ValueError(
                "TUNEYARD_WEBHOOK_SECRET must be at least 16 characters (e.g. the output of "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`)"
            )
        return self

    @field_validator("python_graders")
    @classmethod
    def _python_graders_are_sandboxed(cls, value: bool) -> bool:
        reason = sandbox.unavailable() if value else None
        if reason is not None:
            raise ValueError(f"TUNEYARD_PYTHON_GRADERS: {reason}")
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

    @cached_property
    def storage(self) -> Storage:
        if self.storage_path and is_uri(self.storage_path):
            return Storage(self.storage_path)
        folder = Path(self.storage_path) if self.storage_path else self.home_dir / "storage"
        return Storage(str(folder.expanduser().resolve()))

    @property
    def uploads_location(self) -> str:
        """Where uploaded files are kept, in storage."""
        return self.storage.join(UPLOADS_DIRNAME)

    @property
    def uploads_dir(self) -> Path:
        """Where uploads are received and checked on this machine: their place in storage
        itself when storage is a local folder, else a folder under TUNEYARD_HOME from
        which each is moved to the object store once recorded."""
        if self.storage.remote:
            return self.home_dir / "uploads"
        return Path(self.uploads_location)

    @property
    def resolved_allowed_roots(self) -> SourceRoots:
        if self.allowed_roots:
            roots = [Path(p) for p in self.allowed_roots.split(":") if p]
        else:
            # $TUNEYARD_HOME holds the storage path by default: it stays refused (see
            # SourceRoots), whatever the roots; the demo and the rest may be trained from.
            roots = [self.home_dir, self.home_dir / DEMO_DIRNAME]
        refused: dict[Path, ServiceFolder] = {self.uploads_dir.resolve(): "uploads"}
        if not self.storage.remote:
            refused[Path(self.storage.root).resolve()] = "storage"
        refused[self.ray_state_dir.resolve()] = "state"
        return SourceRoots((r.expanduser().resolve() for r in roots), refused=refused)

    def request_policy(self) -> RequestPolicy:
        """What a request's checks need of these settings (app/services/rules/run_rules.py)."""
        return RequestPolicy(
            roots=self.resolved_allowed_roots,
            webhooks=self.webhook_config(),
            tracking=self.tracking_config(),
            python_graders=self.python_graders,
        )

    def webhook_config(self) -> WebhookConfig:
        """What webhooks need of these settings (checks, the lifecycle's ends, enqueueing)."""
        return WebhookConfig(
            signed=self.webhook_secret is not None,
            urls=tuple(self.webhook_urls),
            events=frozenset(self.webhook_events),
            addresses=AddressPolicy.parse(self.webhook_allowed_networks),
        )

    def tracking_config(self) -> TrackingConfig:
        """What experiment tracking needs of these settings (checks, a run's job env)."""
        return TrackingConfig(
            mlflow_tracking_uri=self.mlflow_tracking_uri, job_env=self.resolved_job_env()
        )

    @property
    def resolved_callback_url(self) -> str:
        if self.callback_url:
            return self.callback_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def resolved_job_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """What every job gets on top of tuneyard's own variables: the service's variables
        that `job_env_passthrough` names (from `environ`, default this process's) and, with
        object storage, its endpoint and credentials variables; then `job_env`, which wins
        where both give a name."""
        environ = os.environ if environ is None else environ
        patterns = _split_names(self.job_env_passthrough)
        if self.storage.remote:  # the workers reach the object store as the service does
            patterns += CREDENTIAL_VARIABLES
        forwarded = {
            name: value
            for name, value in environ.items()
            if any(_matches(pattern, name) for pattern in patterns)
            and not _job_variable_problem(name, glob=False)
        }
        return {**forwarded, **self.job_env}

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


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The service's own connection to Ray: a job gets its address and credentials from Ray.
_RAY_CONNECTION_PREFIX = "RAY_AUTH_"
_RAY_CONNECTION_NAMES = frozenset({"RAY_ADDRESS"})


def _split_names(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _matches(pattern: str, name: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def _job_variable_problem(pattern: str, *, glob: bool) -> str | None:
    """Why a job variable name (or, with `glob`, a `PREFIX*` pattern) may not be given."""
    is_glob = glob and pattern.endswith("*")
    stem = pattern[:-1] if is_glob else pattern
    if is_glob and not stem:
        return "it would pass on every variable of the service, its credentials too"
    if not _ENV_NAME.match(stem):
        shape = "a variable name or a PREFIX_* pattern" if glob else "a variable name"
        return f"it is not {shape}"

    def hits(name_or_prefix: str, *, prefix: bool) -> bool:
        if is_glob:  # the pattern could match it, or it could match what the pattern does
            return name_or_prefix.startswith(stem) or (prefix and stem.startswith(name_or_prefix))
        return stem.startswith(name_or_prefix) if prefix else stem == name_or_prefix

    if hits(RESERVED_PREFIX, prefix=True) or any(
        hits(name, prefix=False) for name in RESERVED_NAMES
    ):
        return (
            "it would replace a variable tuneyard sets for every job "
            f"({RESERVED_PREFIX}*, and {PLACEMENT_TIMEOUT_ENV}, which "
            "TUNEYARD_PLACEMENT_TIMEOUT_S sets)"
        )
    if hits(_RAY_CONNECTION_PREFIX, prefix=True) or any(
        hits(name, prefix=False) for name in _RAY_CONNECTION_NAMES
    ):
        return (
            "it would pass on the service's own connection to Ray "
            f"({_RAY_CONNECTION_PREFIX}*, RAY_ADDRESS); jobs get theirs from Ray"
        )
    return None
