"""/healthz: is the service, its database and its Ray cluster usable?"""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from app.api.deps import JobsDep, SessionDep
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
def get_health(session: SessionDep, jobs: JobsDep) -> dict:
    try:
        session.execute(text("SELECT 1"))
        database = "ok"
    except Exception as exc:  # report, don't raise: health must answer when parts are down
        database = f"error: {type(exc).__name__}"
    # Unauthenticated: the address is shown without the credentials it may carry.
    address = redact_url(jobs.address) if jobs else None
    ray = {
        "address": address,
        "dashboard_url": address,
        "reachable": bool(jobs and jobs.reachable()),
    }
    ok = database == "ok" and ray["reachable"]
    return {"status": "ok" if ok else "degraded", "database": database, "ray": ray}
