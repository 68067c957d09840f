"""/healthz: is the service, its database and its Ray cluster usable?"""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request
from sqlalchemy import text

from app.api.deps import JobsDep, app_state, run_on_read_connection
from app.logs import redact_url
from app.schemas.health import HealthView

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=HealthView,
    summary="Service, database and Ray reachability",
    description="Always 200 while the service answers, without an API key; `status` says "
    "whether the database and Ray are usable. It has no error responses of its own.",
)
async def get_health(request: Request, jobs: JobsDep) -> dict:
    try:
        await run_on_read_connection(request, lambda c: c.execute(text("SELECT 1")))
        database = "ok"
    except Exception as exc:  # report, don't raise: health must answer when parts are down
        database = f"error: {type(exc).__name__}"
    # Unauthenticated: the address is shown without the credentials it may carry.
    address = redact_url(jobs.address) if jobs else None
    # Ray's client sets no timeout: the call waits on threads of its own, holding no
    # database slot, so a hung dashboard holds up health checks and nothing else.
    reachable = jobs is not None and await anyio.to_thread.run_sync(
        jobs.reachable, limiter=app_state(request).ray_calls
    )
    ray = {"address": address, "dashboard_url": address, "reachable": reachable}
    ok = database == "ok" and reachable
    return {"status": "ok" if ok else "degraded", "database": database, "ray": ray}
