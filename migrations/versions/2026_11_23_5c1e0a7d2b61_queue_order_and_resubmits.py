"""queue order by queued_at; resubmits counted apart from Ray Train's restarts

Revision ID: 5c1e0a7d2b61
Revises: 9d79eae37a9a
Create Date: 2026-11-23 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '5c1e0a7d2b61'
down_revision: str | None = '9d79eae37a9a'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resubmits', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True))
    # Existing runs: a queued run was last queued when its row last changed.
    op.execute("UPDATE runs SET queued_at = COALESCE(updated_at, created_at)")
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.alter_column('queued_at', existing_type=sa.DateTime(timezone=True), nullable=False)
        batch_op.create_index('ix_runs_status_queued', ['status', 'queued_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_status_queued')
        batch_op.drop_column('queued_at')
        batch_op.drop_column('resubmits')
