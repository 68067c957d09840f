"""The rules a run's webhooks must meet beyond their schema: the service can sign them, and
each goes where webhooks may go (app/services/rules/webhook_addresses.py)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.errors import field_problem
from app.services.rules.webhook_addresses import destination_problem
from app.services.webhooks import session_config
from contract.run_request import RunDefinition


def webhook_problems(session: Session, request: RunDefinition) -> list[dict[str, str]]:
    """Refused up front rather than sent unsigned: a receiver could not tell tuneyard's
    deliveries from anyone's. And refused up front rather than only when sent: a URL that
    points inside the service's network (checked again on every delivery)."""
    if not request.webhooks:
        return []
    config = session_config(session)
    if not config.signed:
        return [
            field_problem(
                "webhooks",
                "this service has no webhook signing secret (TUNEYARD_WEBHOOK_SECRET), so it "
                "sends no webhooks: ask its operator to set one, or leave webhooks out",
            )
        ]
    return [
        field_problem(f"webhooks.{index}.url", problem)
        for index, hook in enumerate(request.webhooks)
        if (problem := destination_problem(hook.url, config.addresses))
    ]
