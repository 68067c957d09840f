"""shared queue: run priority, preemption and per-key limits

Revision ID: c4a7e1f9d2b8
Revises: b6f2d8e4a913
Create Date: 2026-11-25 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = 'c4a7e1f9d2b8'
down_revision: str | None = 'b6f2d8e4a913'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_running_runs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_queued_runs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_gpus', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_priority', sa.Integer(), nullable=True))
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('priority', sa.Integer(), server_default='50', nullable=False))
        batch_op.add_column(sa.Column('preemptible', sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column('gpus', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('queue_reason', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('attempt_started_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('preempt_requested_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('preempt_reason', sa.Text(), nullable=True))
        batch_op.create_index('ix_runs_status_priority', ['status', 'priority'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_status_priority')
        batch_op.drop_column('preempt_reason')
        batch_op.drop_column('preempt_requested_at')
        batch_op.drop_column('attempt_started_at')
        batch_op.drop_column('queue_reason')
        batch_op.drop_column('gpus')
        batch_op.drop_column('preemptible')
        batch_op.drop_column('priority')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('max_priority')
        batch_op.drop_column('max_gpus')
        batch_op.drop_column('max_queued_runs')
        batch_op.drop_column('max_running_runs')
