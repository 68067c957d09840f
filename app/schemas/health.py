"""What `GET /healthz` answers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class RayHealth(BaseModel):
    address: str | None = Field(
        examples=["http://***@head:8265"],
        description="The Ray address the service uses, its credentials (userinfo) hidden.",
    )
    dashboard_url: str | None = Field(description="The dashboard's URL, credentials hidden.")
    reachable: bool


class HealthView(BaseModel):
    status: Literal["ok", "degraded"] = Field(
        description="`ok` when the database answers and Ray is reachable, else `degraded`."
    )
    database: str = Field(examples=["ok"], description="`ok`, or `error: <exception type>`.")
    ray: RayHealth
