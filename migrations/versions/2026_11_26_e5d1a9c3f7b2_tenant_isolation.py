"""tenant isolation: a webhook signing secret per key (and which secret signs each
delivery), non-preemptible runs as a key permission, tracking destinations an operator pins
per key

Revision ID: e5d1a9c3f7b2
Revises: c4a7e1f9d2b8
Create Date: 2026-11-26 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e5d1a9c3f7b2"
down_revision: str | None = "c4a7e1f9d2b8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_secret", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("allow_non_preemptible", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("tracking_prefix", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("wandb_entity", sa.String(length=100), nullable=True))
    # Which secret signs a delivery: the service's (a service-wide subscriber) or the run
    # owner's key's. A delivery already queued to a URL that is not one of its run's own
    # hooks was the operator's: it stays so (signed with the service's secret, listed to
    # no tenant).
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("service_wide", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    deliveries = sa.table(
        "webhook_deliveries",
        sa.column("id", sa.String),
        sa.column("run_id", sa.String),
        sa.column("url", sa.Text),
        sa.column("service_wide", sa.Boolean),
    )
    runs = sa.table("runs", sa.column("id", sa.String), sa.column("spec", sa.JSON))
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(deliveries.c.id, deliveries.c.url, runs.c.spec).join(
            runs, runs.c.id == deliveries.c.run_id
        )
    ).all()
    for delivery_id, url, spec in rows:
        own = {hook.get("url") for hook in (spec or {}).get("webhooks") or []}
        if url not in own:
            bind.execute(
                deliveries.update().where(deliveries.c.id == delivery_id).values(service_wide=True)
            )
    # Keys made before this revision keep no secret of their own: their runs' deliveries
    # are signed with the service's secret, as before, so that no receiver breaks on the
    # upgrade, until `tuneyard keys rotate-webhook-secret` gives the key one.


def downgrade() -> None:
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.drop_column("service_wide")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("wandb_entity")
        batch_op.drop_column("tracking_prefix")
        batch_op.drop_column("allow_non_preemptible")
        batch_op.drop_column("webhook_secret")
