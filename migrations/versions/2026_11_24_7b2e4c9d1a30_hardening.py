"""hardening: revocable API keys, non-finite metric values, coalesced repeated events

Revision ID: 7b2e4c9d1a30
Revises: 5c1e0a7d2b61
Create Date: 2026-11-24 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '7b2e4c9d1a30'
down_revision: str | None = '5c1e0a7d2b61'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.alter_column('value', existing_type=sa.Float(), nullable=True)
        batch_op.add_column(sa.Column('nonfinite', sa.String(length=4), nullable=True))
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('repeats', sa.Integer(), server_default='1', nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('repeats')
    op.execute("DELETE FROM metrics WHERE value IS NULL")
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_column('nonfinite')
        batch_op.alter_column('value', existing_type=sa.Float(), nullable=False)
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('revoked_at')
