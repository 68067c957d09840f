"""How the CLI shows runs: tables, a run's summary, and the live `watch` view."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from app.cli.client import TuneyardClient
from contract.statuses import TERMINAL_STATUSES

STATUS_STYLE = {
    "queued": "cyan",
    "starting": "cyan",
    "running": "blue",
    "preempting": "yellow",
    "cancelling": "yellow",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
}


def styled(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def runs_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(
        Column("id", no_wrap=True),
        "status",
        "attempt",
        Column("model", overflow="ellipsis", max_width=40),
        "step",
        "loss",
        Column("created", no_wrap=True),
    )
    for run in runs:
        progress = run["progress"]
        total = progress["total_steps"]
        loss = metric_text(run, "loss", ".4f")
        table.add_row(
            run["id"],
            styled(run["status"]),
            str(run["attempt"]),
            str(run["spec"]["model"]),
            f"{progress['step']}/{total or '?'}",
            loss,
            run["created_at"][:19].replace("T", " "),
        )
    return table


def metric_text(view: dict[str, Any], name: str, spec: str = ".4g") -> str:
    """One metric of a run or checkpoint view: a non-finite value is served as null with
    its kind in `nonfinite_metrics`, and shown as that kind."""
    metrics = view.get("latest_metrics", view.get("metrics")) or {}
    value = metrics.get(name)
    if value is None:
        return str((view.get("nonfinite_metrics") or {}).get(name, ""))
    return format(value, spec)


def checkpoints_table(checkpoints: list[dict[str, Any]]) -> Table:
    table = Table(
        "step",
        "kind",
        "attempt",
        Column("path", overflow="fold"),
        "metrics",
        Column("created", no_wrap=True),
    )
    for c in checkpoints:
        metrics = ", ".join(f"{k}={metric_text(c, k)}" for k in sorted(c["metrics"]))
        # The run's best checkpoint, and those keep_last deleted from storage.
        tags = " ".join(
            t for t in ("best" if c.get("best") else "", "pruned" if c.get("pruned") else "") if t
        )
        table.add_row(
            str(c["step"]),
            f"{c['kind']} {tags}".strip(),
            str(c["attempt"]),
            c["path"],
            metrics,
            c["created_at"][:19].replace("T", " "),
        )
    return table


def problems_table(problems: list[dict[str, str]]) -> Table:
    table = Table("field", "problem", title="The request breaks these rules")
    for p in problems:
        table.add_row(p.get("field", ""), p.get("message", ""))
    return table


def print_run(console: Console, run: dict[str, Any]) -> None:
    progress, metrics = run["progress"], run["latest_metrics"]
    console.print(f"[bold]{run['id']}[/]  {styled(run['status'])}  attempt {run['attempt']}")
    console.print(f"  model     {run['spec']['model']}")
    step = f"{progress['step']}/{progress['total_steps'] or '?'}"
    if progress["eta_seconds"] is not None:
        step += f"  (ETA {_duration(progress['eta_seconds'])})"
    console.print(f"  step      {step}")
    if progress.get("estimated_finish"):
        console.print(f"  finish    ~{_local_time(progress['estimated_finish'])}")
    if queue := run.get("queue"):
        console.print(
            f"  queue     position {queue['position']}  priority {run['spec'].get('priority', 50)}"
        )
        if queue.get("reason"):
            console.print(f"  waiting   {queue['reason']}")
    if metrics:
        shown = ", ".join(f"{k}={metric_text(run, k)}" for k in sorted(metrics))
        console.print(f"  metrics   {shown}")
    if run["error"]:
        console.print(f"  [red]error[/]     {run['error']['code']}: {run['error']['message']}")
    if run["output"]["latest_checkpoint"]:
        console.print(f"  checkpoint {run['output']['latest_checkpoint']}")
    if run["output"]["model_path"]:
        console.print(f"  model out {run['output']['model_path']}")
    result = run.get("result") or {}
    if result.get("stop_reason"):
        console.print(f"  stopped   {result['stop_reason'].replace('_', ' ')}")
    if result.get("best_step") is not None:
        console.print(
            f"  best      {result['best_metric']}={result['best_value']:.6g} at step "
            f"{result['best_step']}"
        )


def profile_table(report: dict[str, Any]) -> Table:
    """The static estimate and what the profile measured, side by side, per quantity."""
    estimate, measured = report["estimate"] or {}, report["profile"]
    resolved = report["resolved"] or {}
    peak = (estimate.get("memory_per_worker") or {}).get("peak") or {}
    workers = measured["workers"]
    table = Table(
        "",
        Column("static estimate", justify="right"),
        Column(f"measured ({_steps_measured(measured)})", justify="right"),
        title="Before the GPU hours",
    )

    def row(name: str, static: str | None, real: str | None) -> None:
        table.add_row(name, static or "-", real or "-")

    row("total steps", _text(resolved.get("total_steps")), None)
    row("tokens per step", _text(estimate.get("tokens_per_step")), None)
    row("step time", None, _seconds(measured["step_time_seconds"]))
    row("tokens/s", None, _rate(measured["tokens_per_second"]))
    row("samples/s", None, _rate(measured["samples_per_second"]))
    row("start-up", None, _seconds(measured["startup_seconds"]))
    row("wall time of the run", None, _seconds(measured["estimated_total_seconds"]))
    cost = measured["estimated_cost"]
    row("cost", None, f"{cost:,.2f} {measured['currency']}" if cost is not None else None)
    row(
        "peak device memory / worker",
        _bytes(peak.get("device")) if report["estimate"] else None,
        _per_worker(workers, "peak_device_memory_bytes"),
    )
    row(
        "peak host memory / worker",
        _bytes(peak.get("host")) if report["estimate"] else None,
        _per_worker(workers, "peak_host_memory_bytes"),
    )
    return table


def _steps_measured(measured: dict[str, Any]) -> str:
    if measured["steps_measured"] is None:
        return "failed" if measured["error"] else "none"
    return f"{measured['steps_measured']} of {measured['steps']} steps"


def _text(value: Any) -> str | None:
    return None if value is None else f"{value:,}"


def _seconds(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value:.3g} s" if value < 60 else _duration(value)


def _rate(value: float | None) -> str | None:
    return None if value is None else f"{value:,.1f}"


def _bytes(value: float | None) -> str | None:
    if value is None:
        return None
    size, unit = float(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"


def _per_worker(workers: list[dict[str, Any]], key: str) -> str | None:
    """One value per rank, or the one value they share (`rank: value` where they differ)."""
    values = [_bytes(w[key]) for w in workers]
    if not values or all(v is None for v in values):
        return None
    if len(set(values)) == 1:
        return values[0]
    return ", ".join(f"r{w['rank']} {v or '-'}" for w, v in zip(workers, values, strict=True))


def _local_time(iso: str) -> str:
    """An API time (UTC, ISO 8601) in this machine's time zone, to the second."""
    moment = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def watch_run(
    client: TuneyardClient, run_id: str, console: Console, *, interval_s: float = 1.0
) -> dict[str, Any]:
    """Show a live progress bar (step, loss, tokens/s, ETA) and the run's events until it
    ends; returns the final run."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    last_event: int | None = None
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("", total=None, info="")
        while True:
            run = client.get_run(run_id)
            for event in client.events(run_id, after=last_event):
                last_event = event["id"]
                bar.console.print(f"[dim]{event['created_at'][11:19]}[/] {_describe(event)}")
            progress, metrics = run["progress"], run["latest_metrics"]
            info = f"step {progress['step']}/{progress['total_steps'] or '?'}"
            if "loss" in metrics:
                info += f"  loss {metric_text(run, 'loss', '.4f')}"
            if "tokens_per_second" in metrics:
                info += f"  {metric_text(run, 'tokens_per_second', '.0f')} tok/s"
            if progress["eta_seconds"] is not None:
                info += f"  ETA {_duration(progress['eta_seconds'])}"
            bar.update(
                task,
                description=styled(run["status"]),
                total=progress["total_steps"],
                completed=progress["step"],
                info=info,
            )
            if run["status"] in TERMINAL_STATUSES:
                return run
            time.sleep(interval_s)


def _describe(event: dict[str, Any]) -> str:
    if event["type"] == "status" and event["status"]:
        return f"{styled(event['status'])} {event['message']}".rstrip()
    return str(event["message"])


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
