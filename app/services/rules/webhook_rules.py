"""The rules a run's webhooks must meet beyond their schema: the service can sign them, and
each goes where webhooks may go (app/services/rules/webhook_addresses.py). `WebhookConfig`
is what webhooks need of the service's settings (`Settings.webhook_config`), passed to
these checks, to the lifecycle's ends and to enqueueing (app/services/webhooks.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.errors import field_problem
from app.services.rules.webhook_addresses import AddressPolicy, destination_problem
from contract.run_request import RunDefinition


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """The default is a service without a signing secret: it sends no webhooks."""

    signed: bool = False  # a secret is set: runs may ask for webhooks
    urls: tuple[str, ...] = ()  # service-wide subscribers
    events: frozenset[str] = frozenset()  # what the service-wide subscribers get
    # Where runs' webhooks may go (TUNEYARD_WEBHOOK_ALLOWED_NETWORKS beside public addresses).
    addresses: AddressPolicy = field(default_factory=AddressPolicy)


def webhook_problems(request: RunDefinition, config: WebhookConfig) -> list[dict[str, str]]:
    """Refused up front rather than sent unsigned: a receiver could not tell tuneyard's
    deliveries from anyone's. And refused up front rather than only when sent: a URL that
    points inside the service's network (checked again on every delivery)."""
    if not request.webhooks:
        return []
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
