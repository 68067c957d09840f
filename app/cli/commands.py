"""The `tuneyard` command line: run the service, and drive it over HTTP from a shell.

Exit codes are part of the interface (scripts rely on them); see `ExitCode`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console

from app.cli.client import ApiError, TuneyardClient, Unreachable
from app.cli.render import (
    checkpoints_table,
    print_run,
    problems_table,
    profile_table,
    runs_table,
    watch_run,
)
from app.settings import Settings
from contract.statuses import TERMINAL_STATUSES


class ExitCode(IntEnum):
    OK = 0
    RUN_FAILED = 1  # `watch` (and `submit --watch`): the run ended `failed`
    USAGE = 2  # a bad command line or an unreadable spec file
    # The service refused the request: invalid (422), conflicting (409), or over the API
    # key's max_queued_runs (429).
    REFUSED = 3
    NOT_FOUND = 4
    RUN_CANCELLED = 5  # `watch`: the run ended `cancelled`
    UNREACHABLE = 6  # no answer from the service
    UNAUTHORIZED = 7  # missing or wrong API key


app = typer.Typer(
    help="tuneyard: fine-tune language models on Ray Train + DeepSpeed over HTTP.",
    no_args_is_help=True,
)
keys_app = typer.Typer(help="Manage API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

out = Console(soft_wrap=True)  # paths stay on one line, copyable
err = Console(stderr=True, soft_wrap=True)


@app.callback()
def _connection(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option(envvar="TUNEYARD_URL", help="The service's base URL.")
    ] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None,
        typer.Option(envvar="TUNEYARD_API_KEY", help="API key (from `tuneyard keys create`)."),
    ] = None,
) -> None:
    ctx.obj = {"url": url, "api_key": api_key}


@contextmanager
def _client(ctx: typer.Context) -> Iterator[TuneyardClient]:
    """The connection from the global options; service errors become exit codes."""
    try:
        with TuneyardClient(ctx.obj["url"], ctx.obj["api_key"]) as client:
            yield client
    except Unreachable as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(ExitCode.UNREACHABLE) from None
    except ApiError as exc:
        raise typer.Exit(_report(exc)) from None


def _report(exc: ApiError) -> ExitCode:
    if exc.status_code == 422 and isinstance(exc.detail, list):
        err.print(problems_table(exc.detail))
    else:
        err.print(f"[red]error ({exc.status_code} {exc.error}):[/] {exc.detail}")
    if exc.status_code == 401:
        err.print("Set TUNEYARD_API_KEY or pass --api-key (see `tuneyard keys create`).")
        return ExitCode.UNAUTHORIZED
    if exc.status_code == 404:
        return ExitCode.NOT_FOUND
    if exc.status_code in (409, 413, 422, 429):
        return ExitCode.REFUSED
    return ExitCode.RUN_FAILED


def _read_spec(path: str) -> dict[str, Any]:
    """A run request from a YAML or JSON file (JSON is YAML), or `-` for standard input."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        spec = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        err.print(f"[red]error:[/] cannot read the spec {path}: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    if not isinstance(spec, dict):
        err.print(f"[red]error:[/] the spec {path} must be a mapping (a run request object)")
        raise typer.Exit(ExitCode.USAGE)
    return spec


def _settings(**overrides: Any) -> Settings:
    """The service's settings, or a readable refusal naming each bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        for problem in exc.errors():
            loc = "_".join(str(part) for part in problem["loc"]).upper()
            name = f"TUNEYARD_{loc}" if loc else "settings"
            err.print(f"[red]invalid {name}:[/] {problem['msg'].removeprefix('Value error, ')}")
        raise typer.Exit(ExitCode.USAGE) from None


def _print_json(value: Any) -> None:
    out.print_json(json.dumps(value))


def _ended(run: dict[str, Any]) -> ExitCode:
    print_run(out, run)
    return {
        "succeeded": ExitCode.OK,
        "cancelled": ExitCode.RUN_CANCELLED,
    }.get(run["status"], ExitCode.RUN_FAILED)


SpecArg = Annotated[str, typer.Argument(help="Run request as a YAML or JSON file; - for stdin.")]
RunIdArg = Annotated[str, typer.Argument(help="The run's id.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead.")]


@app.command()
def serve(
    host: str = typer.Option(None, help="Bind address (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port (default 8000)."),
    workers: int = typer.Option(None, min=1, help="HTTP worker processes (default 1)."),
) -> None:
    """Run the service; with no TUNEYARD_RAY_ADDRESS it starts and stops a local Ray head."""
    import uvicorn

    from app.logs import configure_logging

    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port, "workers": workers}.items() if v is not None
    }
    settings = _settings(**overrides)
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    # log_config=None: uvicorn's own loggers go through the handler configured above.
    server: dict[str, Any] = {"log_config": None, "log_level": settings.log_level.lower()}
    if settings.workers == 1:
        from app.main import create_app

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **server)
        return
    _serve_workers(settings, server)


def _serve_workers(settings: Settings, server: dict[str, Any]) -> None:
    """N uvicorn worker processes on one socket. This parent prepares what they share
    (the schema, the embedded Ray head) so they do not race for it, and stops the head
    when they are done."""
    import os

    import uvicorn

    from app.cluster.ray_head import ensure_local_head, stop_local_head
    from app.storage.db import make_engine
    from app.storage.migrate import prepare_database

    make_engine(settings.resolved_database_url).dispose()  # creates a SQLite file's folder
    prepare_database(settings.resolved_database_url, wait_s=settings.database_wait_s)
    owns_head = not settings.ray_address
    if owns_head:
        ensure_local_head(settings)  # the workers re-attach to it
    # The workers are fresh interpreters that read their settings from the environment.
    os.environ.update(
        {f"TUNEYARD_{k.upper()}": str(getattr(settings, k)) for k in ("host", "port", "workers")}
    )
    try:
        uvicorn.run(
            "app.main:create_worker_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            **server,
        )
    finally:
        if owns_head:
            stop_local_head(settings)


@app.command()
def submit(
    ctx: typer.Context,
    spec: SpecArg,
    watch: Annotated[bool, typer.Option("--watch", help="Then watch it to the end.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe: the same key and spec give the same run.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a run; prints its id (exit 3 and every broken rule if it is refused)."""
    body = _read_spec(spec)
    with _client(ctx) as client:
        run = client.create_run(body, idempotency_key=idempotency_key)
        if as_json:
            _print_json(run)
        else:
            out.print(run["id"])
        if watch:
            raise typer.Exit(_ended(watch_run(client, run["id"], err)))


@app.command()
def validate(
    ctx: typer.Context,
    spec: SpecArg,
    as_json: JsonOpt = False,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Also train a few real steps on the cluster and show what they measured "
            "beside the static estimate (takes as long as loading the model).",
        ),
    ] = False,
    profile_steps: Annotated[
        int | None,
        typer.Option(help="Steps the profile trains (2-50; the first are warm-up)."),
    ] = None,
) -> None:
    """Check a spec without creating a run; exit 0 when valid, 3 when not.

    Prints every broken rule, or the resolved DeepSpeed config and the cost estimate; with
    --profile, the measured numbers too (a profile that failed exits 1).
    """
    body = _read_spec(spec)
    with _client(ctx) as client:
        report = client.validate(body, profile=profile, profile_steps=profile_steps)
    measured = report.get("profile")
    if as_json:
        _print_json(report)
    elif report["valid"]:
        resolved, estimate = report["resolved"], report["estimate"]
        out.print("[green]valid[/]")
        _print_json({"resolved": resolved, "estimate": estimate})
        if measured is not None:
            out.print(profile_table(report))
            if measured["error"]:
                error = measured["error"]
                err.print(f"[red]profile failed[/] {error['code']}: {error['message']}")
    else:
        err.print(problems_table(report["errors"]))
    if not report["valid"]:
        raise typer.Exit(ExitCode.REFUSED)
    # Valid, but its steps failed on the cluster (out of memory, say): the run would too.
    raise typer.Exit(ExitCode.RUN_FAILED if measured and measured["error"] else ExitCode.OK)


@app.command("list")
def list_runs(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option(help="Only runs in this status.")] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE; repeatable.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many runs.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first."""
    pairs: dict[str, str] = {}
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            err.print(f"[red]error:[/] --metadata wants KEY=VALUE, got {item!r}")
            raise typer.Exit(ExitCode.USAGE)
        pairs[key] = value
    with _client(ctx) as client:
        runs = client.list_runs(status=status, metadata=pairs, limit=limit)
    if as_json:
        _print_json(runs)
    else:
        out.print(runs_table(runs))


@app.command()
def status(ctx: typer.Context, run_id: RunIdArg, as_json: JsonOpt = False) -> None:
    """One run: status, progress, latest metrics, error and outputs."""
    with _client(ctx) as client:
        run = client.get_run(run_id)
    if as_json:
        _print_json(run)
    else:
        print_run(out, run)


@app.command()
def watch(
    ctx: typer.Context,
    run_id: RunIdArg,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 1.0,
) -> None:
    """Follow a run to its end with a live progress bar; exit 0/1/5: succeeded/failed/cancelled.

    Shows step, loss, tokens/s and ETA, and the run's events as they happen.
    """
    with _client(ctx) as client:
        run = watch_run(client, run_id, err, interval_s=interval)
    raise typer.Exit(_ended(run))


@app.command()
def logs(
    ctx: typer.Context,
    run_id: RunIdArg,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")
    ] = False,
    tail: Annotated[int | None, typer.Option(min=1, help="Only the last N lines.")] = None,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 2.0,
) -> None:
    """The run's Ray job log (tokens redacted)."""
    with _client(ctx) as client:
        if not follow:
            sys.stdout.write(client.logs(run_id, tail=tail))
            return
        printed: int | None = None
        while True:
            ended = client.get_run(run_id)["status"] in TERMINAL_STATUSES
            try:
                lines = client.logs(run_id).splitlines()
            except ApiError as exc:
                if exc.status_code != 503:
                    raise
                lines = []  # Ray is briefly unreachable: try again on the next poll
            if printed is None:
                printed = max(len(lines) - tail, 0) if tail else 0
            for line in lines[printed:]:
                sys.stdout.write(line + "\n")
            sys.stdout.flush()
            printed = max(printed, len(lines))
            if ended:
                return
            time.sleep(interval)


@app.command()
def cancel(ctx: typer.Context, run_id: RunIdArg) -> None:
    """Cancel a run (exit 3 if it already finished)."""
    with _client(ctx) as client:
        run = client.cancel(run_id)
    out.print(f"{run['id']} {run['status']}")


@app.command()
def resume(ctx: typer.Context, run_id: RunIdArg) -> None:
    """Resume a failed or cancelled run from its latest checkpoint (exit 3 otherwise)."""
    with _client(ctx) as client:
        run = client.resume(run_id)
    out.print(f"{run['id']} {run['status']} (attempt {run['attempt']})")


@app.command()
def download(
    ctx: typer.Context,
    run_id: RunIdArg,
    dest: Annotated[
        Path | None,
        typer.Argument(help="A new folder for the model; default ./<run id>-model."),
    ] = None,
) -> None:
    """Download a run's exported model into a folder that from_pretrained loads."""
    target = dest or Path(f"{run_id}-model")
    with _client(ctx) as client:
        try:
            folder = client.download_model(run_id, target)
        except FileExistsError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(ExitCode.USAGE) from None
    out.print(f"{run_id}: model in {folder}")


@app.command()
def checkpoints(ctx: typer.Context, run_id: RunIdArg, as_json: JsonOpt = False) -> None:
    """A run's checkpoints: DeepSpeed ones and the exported Hugging Face model."""
    with _client(ctx) as client:
        data = client.checkpoints(run_id)
    if as_json:
        _print_json(data)
    else:
        out.print(checkpoints_table(data))


_LIMIT_HELP = {
    "max_running_runs": "Runs of this key live at once (more wait in the queue).",
    "max_queued_runs": "Runs of this key queued at once (more are refused with 429).",
    "max_gpus": "GPUs this key's live runs hold at once (more wait in the queue).",
    "max_priority": "The highest priority this key's runs may ask for (0-100; above: 422).",
}

# The limits' options, as `keys create` and `keys update` both take them.
MaxRunningRuns = Annotated[
    str | None, typer.Option(metavar="N|none", help=_LIMIT_HELP["max_running_runs"])
]
MaxQueuedRuns = Annotated[
    str | None, typer.Option(metavar="N|none", help=_LIMIT_HELP["max_queued_runs"])
]
MaxGpus = Annotated[str | None, typer.Option(metavar="N|none", help=_LIMIT_HELP["max_gpus"])]
MaxPriority = Annotated[
    str | None, typer.Option(metavar="N|none", help=_LIMIT_HELP["max_priority"])
]
# What the key's runs may ask for beyond its share, taken alike (`none` lifts a name).
AllowNonPreemptible = Annotated[
    bool | None,
    typer.Option(
        "--allow-non-preemptible/--no-allow-non-preemptible",
        help="May this key's runs set preemptible false, holding what no higher priority can "
        "take back? Not given at creation: yes, unless --max-priority caps the key.",
    ),
]
TrackingPrefix = Annotated[
    str | None,
    typer.Option(
        metavar="PREFIX|none",
        help="The MLflow experiment and W&B project of this key's runs must start with it "
        "(others: 422; unset: PREFIX + 'tuneyard').",
    ),
]
WandbEntity = Annotated[
    str | None,
    typer.Option(
        metavar="ENTITY|none",
        help="The only W&B entity this key's runs may log to (another: 422; unset: ENTITY).",
    ),
]


def _limits(**given: str | None) -> dict[str, int | None]:
    """The limits given on the command line: a number, or `none` for no limit."""
    from app.services.api_keys import UNLIMITED

    limits: dict[str, int | None] = {}
    for name, value in given.items():
        if value is None:
            continue
        if value.strip().lower() == UNLIMITED:
            limits[name] = None
            continue
        try:
            limits[name] = int(value)
        except ValueError:
            flag = "--" + name.replace("_", "-")
            raise typer.BadParameter(
                f"{value!r} is not a whole number or 'none'", param_hint=flag
            ) from None
    return limits


def _permissions(
    allow_non_preemptible: bool | None, **names: str | None
) -> dict[str, bool | str | None]:
    """The permissions given on the command line; a name's `none` lifts it."""
    from app.services.api_keys import UNLIMITED

    given: dict[str, bool | str | None] = {}
    if allow_non_preemptible is not None:
        given["allow_non_preemptible"] = allow_non_preemptible
    for name, value in names.items():
        if value is not None:
            given[name] = None if value.strip().lower() == UNLIMITED else value
    return given


def _refused(exc: Exception) -> NoReturn:
    from app.errors import ValidationFailed

    if isinstance(exc, ValidationFailed):
        for problem in exc.detail:
            err.print(f"[red]error:[/] {problem['field']}: {problem['message']}")
    else:
        err.print(f"[red]error:[/] {getattr(exc, 'detail', exc)}")
    raise typer.Exit(ExitCode.REFUSED)


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., "--name", help="Who the key is for."),
    max_running_runs: MaxRunningRuns = None,
    max_queued_runs: MaxQueuedRuns = None,
    max_gpus: MaxGpus = None,
    max_priority: MaxPriority = None,
    allow_non_preemptible: AllowNonPreemptible = None,
    tracking_prefix: TrackingPrefix = None,
    wandb_entity: WandbEntity = None,
) -> None:
    """Create an API key in the service's database and print it (it is shown only once).
    Without a limit, the key has none. The key's webhook signing secret, which signs its
    runs' webhooks, is printed on stderr, also once (`keys rotate-webhook-secret` replaces
    it), so that stdout stays the key alone for scripts."""
    from app.errors import ValidationFailed
    from app.services.api_keys import issue_api_key

    limits = _key_settings(
        max_running_runs,
        max_queued_runs,
        max_gpus,
        max_priority,
        allow_non_preemptible,
        tracking_prefix,
        wandb_entity,
    )
    try:
        issued = issue_api_key(_settings().resolved_database_url, name=name, limits=limits)
    except ValidationFailed as exc:
        _refused(exc)
    typer.echo(issued.secret)
    err.print(f"{WEBHOOK_SECRET_LABEL} {issued.webhook_secret}", markup=False, highlight=False)


def _key_settings(
    max_running_runs: str | None,
    max_queued_runs: str | None,
    max_gpus: str | None,
    max_priority: str | None,
    allow_non_preemptible: bool | None,
    tracking_prefix: str | None,
    wandb_entity: str | None,
) -> dict[str, Any]:
    """A key's limits and permissions as `keys create` and `keys update` both take them."""
    return {
        **_limits(
            max_running_runs=max_running_runs,
            max_queued_runs=max_queued_runs,
            max_gpus=max_gpus,
            max_priority=max_priority,
        ),
        **_permissions(
            allow_non_preemptible, tracking_prefix=tracking_prefix, wandb_entity=wandb_entity
        ),
    }


# How `keys create` labels the webhook signing secret on stderr (scripts look for it).
WEBHOOK_SECRET_LABEL = "webhook signing secret (shown once; verifies Tuneyard-Signature):"


@keys_app.command("rotate-webhook-secret")
def keys_rotate_webhook_secret(
    key: Annotated[str, typer.Argument(help="The key's id, or the name of its one live key.")],
) -> None:
    """Replace a key's webhook signing secret and print the new one (shown only once). Its
    runs' deliveries are signed with it from now on, retries of earlier ones included.
    Exit 4 if no key matches, 3 if several live keys share the name."""
    from app.errors import Conflict, NotFound
    from app.services.api_keys import rotate_webhook_secret_in

    try:
        _, secret = rotate_webhook_secret_in(_settings().resolved_database_url, ref=key)
    except NotFound as exc:
        err.print(f"[red]error:[/] {exc.detail}")
        raise typer.Exit(ExitCode.NOT_FOUND) from None
    except Conflict as exc:
        err.print(f"[red]error:[/] {exc.detail}")
        raise typer.Exit(ExitCode.REFUSED) from None
    typer.echo(secret)


@keys_app.command("update")
def keys_update(
    key: Annotated[str, typer.Argument(help="The key's id, or the name of its one live key.")],
    max_running_runs: MaxRunningRuns = None,
    max_queued_runs: MaxQueuedRuns = None,
    max_gpus: MaxGpus = None,
    max_priority: MaxPriority = None,
    allow_non_preemptible: AllowNonPreemptible = None,
    tracking_prefix: TrackingPrefix = None,
    wandb_entity: WandbEntity = None,
) -> None:
    """Change a key's limits and permissions (`none` lifts one; one not given stays). Every service
    replica applies them from its next scheduling pass; runs already started keep running.
    Exit 4 if no key matches, 3 if several live keys share the name or a limit is invalid."""
    from app.errors import Conflict, NotFound, ValidationFailed
    from app.services.api_keys import update_api_key_in

    limits = _key_settings(
        max_running_runs,
        max_queued_runs,
        max_gpus,
        max_priority,
        allow_non_preemptible,
        tracking_prefix,
        wandb_entity,
    )
    try:
        updated = update_api_key_in(_settings().resolved_database_url, ref=key, limits=limits)
    except NotFound as exc:
        err.print(f"[red]error:[/] {exc.detail}")
        raise typer.Exit(ExitCode.NOT_FOUND) from None
    except (Conflict, ValidationFailed) as exc:
        _refused(exc)
    out.print(f"{updated.id} ({updated.name}): {_limits_text(updated)}")


def _limits_text(key: Any) -> str:
    from app.services.api_keys import LIMITS, PERMISSIONS

    set_ = [f"{name} {getattr(key, name)}" for name in LIMITS if getattr(key, name) is not None]
    set_ += [
        f"{name} {json.dumps(getattr(key, name))}"
        for name in PERMISSIONS
        if getattr(key, name) is not None
    ]
    return ", ".join(set_) or "no limits"


def _non_preemptible_text(allowed: bool | None) -> str:
    """A key's allow_non_preemptible as `keys list` shows it; unset: the default rule."""
    return "unless capped" if allowed is None else ("yes" if allowed else "no")


@keys_app.command("list")
def keys_list(as_json: JsonOpt = False) -> None:
    """Every API key: id, name, when created, when revoked, its permissions and its limits
    (never a secret)."""
    from rich.table import Column, Table

    from app.services.api_keys import LIMITS, PERMISSIONS, api_keys_in

    keys: list[dict[str, Any]] = [
        {
            "id": key.id,
            "name": key.name,
            "created_at": key.created_at.isoformat(),
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
            **{name: getattr(key, name) for name in (*LIMITS, *PERMISSIONS)},
        }
        for key in api_keys_in(_settings().resolved_database_url)
    ]
    if as_json:
        _print_json(keys)
        return
    table = Table(
        Column("id", no_wrap=True),
        "name",
        "created",
        "revoked",
        "non-preemptible",
        "tracking prefix",
        "wandb entity",
        *(Column(name.removeprefix("max_").replace("_", " "), justify="right") for name in LIMITS),
    )
    for key in keys:
        revoked = key["revoked_at"]
        table.add_row(
            key["id"],
            key["name"],
            _when(key["created_at"]),
            f"[red]{_when(revoked)}[/]" if revoked else "",
            _non_preemptible_text(key["allow_non_preemptible"]),
            key["tracking_prefix"] or "-",
            key["wandb_entity"] or "-",
            *("-" if key[name] is None else str(key[name]) for name in LIMITS),
        )
    out.print(table)


def _when(iso: str) -> str:
    return iso[:19].replace("T", " ")


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="The key's id, or the name of its one live key.")],
) -> None:
    """Revoke an API key: every service process sharing the database refuses it from its
    next request on. Exit 4 if no key matches, 3 if several live keys share the name."""
    from app.errors import Conflict, NotFound
    from app.services.api_keys import revoke_api_key_in

    try:
        revoked = revoke_api_key_in(_settings().resolved_database_url, ref=key)
    except NotFound as exc:
        err.print(f"[red]error:[/] {exc.detail}")
        raise typer.Exit(ExitCode.NOT_FOUND) from None
    except Conflict as exc:
        err.print(f"[red]error:[/] {exc.detail}")
        raise typer.Exit(ExitCode.REFUSED) from None
    when = _when(revoked.revoked_at.isoformat()) if revoked.revoked_at else ""
    out.print(f"{revoked.id} ({revoked.name}) revoked {when}")


@app.command()
def demo(
    steps: int = typer.Option(30, help="Training steps of the demo run."),
    port: int = typer.Option(None, help="Port for the demo service (default: a free one)."),
    hub: bool = typer.Option(
        False,
        "--hub",
        help="Use hub ids (gpt2 on ag_news) instead of the tiny local model; needs a "
        "reachable model and dataset hub.",
    ),
) -> None:
    """Start the service, fine-tune over HTTP, watch it, and show the exported model.

    Offline by default: a tiny GPT-2, tokenizer and dataset are built locally.
    """
    from app.cli.demo import run_demo

    raise typer.Exit(run_demo(steps=steps, port=port, hub=hub))


def main() -> None:
    app()
