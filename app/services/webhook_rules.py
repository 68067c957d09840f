"""The rule a run's webhooks must meet beyond their schema: the service can sign them."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.errors import field_problem
from app.services.webhooks import session_config
from contract.run_request import RunDefinition


def webhook_problems(session: Session, request: RunDefinition) -> list[dict[str, str]]:
    """Refused up front rather than sent unsigned: a receiver could not tell tuneyard's
    deliveries from anyone's."""
    if not request.webhooks or session_config(session).signed:
        return []
    return [
        field_problem(
            "webhooks",
            "this service has no webhook signing secret (TUNEYARD_WEBHOOK_SECRET), so it "
            "sends no webhooks: ask its operator to set one, or leave webhooks out",
        )
    ]
