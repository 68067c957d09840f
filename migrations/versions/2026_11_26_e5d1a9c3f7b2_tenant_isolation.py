"""tenant isolation: a webhook signing secret per key (and which secret signs each
delivery), non-preemptible runs as a key permission, tracking destinations an operator pins
per key

Revision ID: e5d1a9c3f7b2
Revises: c4a7e1f9d2b8
Create Date: 2026-11-26 21:00:00
"""

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'e5d1a9c3f7b2'
down_revision: str | None = 'c4a7e1f9d2b8'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('webhook_secret', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('allow_non_preemptible', sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column('tracking_prefix', sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column('wandb_entity', sa.String(length=100), nullable=True))
    # Which secret signs a delivery: the service's (a service-wide subscriber) or the run
    # owner's key's. Deliveries already queued are taken as the run's own.
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('service_wide', sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    # Keys made before this revision get a signing secret of their own too; their holders
    # read it with `tuneyard keys rotate-webhook-secret`, which replaces it.
    api_keys = sa.table(
        'api_keys', sa.column('id', sa.String), sa.column('webhook_secret', sa.String)
    )
    bind = op.get_bind()
    for (key_id,) in bind.execute(sa.select(api_keys.c.id)).all():
        bind.execute(
            api_keys.update()
            .where(api_keys.c.id == key_id)
            .values(webhook_secret=secrets.token_hex(32))
        )


def downgrade() -> None:
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.drop_column('service_wide')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('wandb_entity')
        batch_op.drop_column('tracking_prefix')
        batch_op.drop_column('allow_non_preemptible')
        batch_op.drop_column('webhook_secret')
