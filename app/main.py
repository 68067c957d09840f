"""The FastAPI application and its lifecycle: migrate, attach to Ray, dispatch."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.api import (
    dashboard,
    files,
    fine_tuning,
    graders,
    health,
    internal,
    prometheus,
    runs,
    webhooks,
)
from app.api.deps import AppState
from app.api.error_handlers import install_error_handlers
from app.api.security_headers import SecurityHeadersMiddleware
from app.cluster.ray_head import ensure_local_head, stop_local_head
from app.cluster.ray_jobs import RayJobs
from app.logs import RunIdMiddleware
from app.metrics import ServiceMetrics
from app.schemas.profile import ValidateRequest
from app.services.dispatch import Dispatcher
from app.services.placement import ClusterView
from app.services.profiles import ProfileReaper
from app.services.webhook_delivery import WebhookDeliverer
from app.settings import Settings
from app.storage.db import make_engine, make_read_engine, make_session_factory
from app.storage.migrate import prepare_database
from app.storage.request_access import RequestDatabase

log = logging.getLogger("tuneyard")


def create_app(
    settings: Settings | None = None,
    *,
    start_background: bool = True,
    owns_local_head: bool = True,
) -> FastAPI:
    """`start_background=False` gives the HTTP layer alone (no Ray, no dispatcher): for tests
    of the API and for tools that only read. `owns_local_head=False`: one of several worker
    processes of `serve --workers N`; the parent process stops the embedded head."""
    settings = settings or Settings()
    engine = make_engine(settings.resolved_database_url)
    read_engine = make_read_engine(settings.resolved_database_url, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        prepare_database(settings.resolved_database_url, wait_s=settings.database_wait_s)
        # Fail at start-up, saying why, not at the first upload or run.
        settings.storage.check_reachable()
        head = None
        deliverer: WebhookDeliverer | None = None
        reaper: ProfileReaper | None = None
        if start_background:
            if settings.ray_address:
                # A remote cluster's token: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN(_PATH),
                # as Ray reads them.
                address = settings.ray_address
            else:
                head = ensure_local_head(settings)
                address = head.dashboard_url
            jobs = state.jobs = RayJobs(address)
            state.cluster = ClusterView(jobs.node_resources, autoscales=settings.cluster_autoscales)
            state.cluster.refresh()  # known before the first request asks

            def revive_local_head() -> None:
                """The embedded head died: start (or re-attach to) one and point Ray at it."""
                nonlocal head
                if head is None:
                    return
                head = ensure_local_head(settings)
                jobs.retarget(head.dashboard_url)

            dispatcher = state.dispatcher = Dispatcher(
                settings=settings,
                session_factory=state.database.session_factory,
                read_session_factory=state.database.read_session_factory,
                jobs=jobs,
                revive_ray=revive_local_head if head is not None else None,
                metrics=state.metrics,
                cluster=state.cluster,
            )
            dispatcher.start()
            # Profiles a crash left running, and their files, go first thing (and any a
            # later one leaves, every few minutes).
            reaper = ProfileReaper(settings=settings, jobs=jobs, slots=state.profile_slots)
            reaper.start()
            if settings.webhook_secret is not None:  # without one, no run has webhooks
                deliverer = WebhookDeliverer(
                    settings=settings, session_factory=state.database.session_factory
                )
                deliverer.start()
        # What start-up made (about 130k objects: FastAPI, SQLAlchemy, pydantic) lives as long
        # as the process. Left to the collector, every full collection walks all of it, a
        # pause of tens of milliseconds (150 ms on a busy 2-core machine) that lands on
        # whatever requests are in flight: status polling's tail. Only in a serving process:
        # an app built without the background parts (tests build hundreds) would pin each
        # one's cycles for good.
        if start_background:
            gc.freeze()
        try:
            yield
        finally:
            if deliverer is not None:
                deliverer.stop()
            if reaper is not None:
                reaper.stop()
            if state.dispatcher is not None:
                state.dispatcher.stop()
            if head is not None and owns_local_head:
                # A clean shutdown stops the head; after a crash it lives on to be re-attached.
                stop_local_head(settings)
            engine.dispose()
            read_engine.dispose()

    app = FastAPI(
        title="tuneyard",
        version="0.1.0",
        summary="Fine-tune language models on Ray Train + DeepSpeed over HTTP.",
        lifespan=lifespan,
        generate_unique_id_function=operation_id,
        # Served by app/api/dashboard.py from vendored assets, at the same paths.
        docs_url=None,
        redoc_url=None,
    )
    mark_uploads_binary(app)
    document_bodies_read_as_json(app, ValidateRequest)
    read_session_factory = make_session_factory(read_engine)
    state = app.state.tuneyard = AppState(
        settings=settings,
        database=RequestDatabase(make_session_factory(engine), read_session_factory),
        metrics=ServiceMetrics(read_session_factory),
    )
    install_error_handlers(app)
    app.add_middleware(RunIdMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)  # outermost: every answer, errors included
    app.include_router(runs.router)
    app.include_router(webhooks.router)
    app.include_router(files.router)
    app.include_router(fine_tuning.router)
    app.include_router(graders.router)
    app.include_router(internal.router)
    app.include_router(health.router)
    app.include_router(prometheus.router)
    app.include_router(dashboard.router)
    app.mount(dashboard.STATIC_URL, dashboard.static_files(), name="static")
    return app


def operation_id(route: APIRoute) -> str:
    """The endpoint function's name, a plain verb (`create_run`, `get_file`): what a client
    generated from the document calls, and stable while paths and tags change. FastAPI's
    default (`create_run_v1_runs_post`) leaks the path and method into every client."""
    return route.name


def mark_uploads_binary(app: FastAPI) -> None:
    """Put `format: binary` beside each `contentMediaType: application/octet-stream` in the
    app's document. OpenAPI 3.1 writes an upload that way, but most client generators
    (openapi-python-client 0.29 among them) know a file only by the 3.0 `format`, and would
    send the upload as a text field. The two say the same thing."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _mark_binary(build())  # FastAPI builds the document once, then serves it
        return build()

    app.openapi = openapi  # type: ignore[method-assign]


def document_bodies_read_as_json(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add to the document's components the schemas of bodies that routes read as plain
    JSON and validate themselves: `POST /v1/runs/validate` answers a body that breaks rules
    with a report, not a 422, so FastAPI never sees its model and would leave its `$ref`
    dangling. The parts FastAPI lists already (the run request's) stay as it wrote them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        document = build()
        if fresh:
            _, schemas = models_json_schema(
                [(model, "validation") for model in models],
                ref_template="#/components/schemas/{model}",
            )
            listed = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in schemas.get("$defs", {}).items():
                listed.setdefault(name, schema)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _mark_binary(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("contentMediaType") == "application/octet-stream":
            node.setdefault("format", "binary")
        for value in node.values():
            _mark_binary(value)
    elif isinstance(node, list):
        for value in node:
            _mark_binary(value)


def create_worker_app() -> FastAPI:
    """The app in each worker process of `tuneyard serve --workers N` (uvicorn's factory):
    settings from the environment, like the parent's."""
    from app.logs import configure_logging

    settings = Settings()
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    return create_app(settings, owns_local_head=False)
