"""/v1/runs/{id}/webhooks: what became of a run's webhook deliveries."""

from __future__ import annotations

from fastapi import APIRouter, Security

from app.api.deps import CurrentPrincipal, SessionDep
from app.api.runs import RunId
from app.schemas.errors import error_responses
from app.schemas.security_schemes import api_key
from app.schemas.webhook_view import WebhookDeliveryList, WebhookDeliveryView
from app.services import runs, webhooks

router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[Security(api_key)])


@router.get(
    "/{run_id}/webhooks",
    response_model=WebhookDeliveryList,
    summary="A run's webhook deliveries and their outcome, oldest first",
    responses=error_responses(
        {
            401: "Missing or invalid API key",
            404: "No such run (or not yours)",
            422: "A parameter breaks a rule; `detail` names it and the rule",
        }
    ),
)
def list_webhook_deliveries(
    run_id: RunId, session: SessionDep, principal: CurrentPrincipal
) -> WebhookDeliveryList:
    run = runs.get_run(session, run_id=run_id, owner_id=principal.id)
    return WebhookDeliveryList(
        data=[WebhookDeliveryView.of(d) for d in webhooks.list_deliveries(session, run=run)]
    )
