"""shared queue: run priority, preemption and per-key limits

Revision ID: c4a7e1f9d2b8
Revises: b6f2d8e4a913
Create Date: 2026-11-25 12:00:00
"""

import math
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
    _backfill_gpus()


# The statuses of runs that wait or hold the cluster: the only ones quotas and fair share read.
_NOT_DONE = ('queued', 'starting', 'running', 'cancelling')


def _backfill_gpus() -> None:
    """Runs already queued or live ask for the GPUs their spec says (the rule of
    app/services/scheduling.Ask, frozen here as of this revision), not the column's 0:
    quotas and fair share read the column. (A resume checks max_gpus against the spec.)"""
    runs = sa.table('runs', sa.column('id', sa.String), sa.column('status', sa.String),
                    sa.column('spec', sa.JSON), sa.column('gpus', sa.Integer))
    conn = op.get_bind()
    rows = conn.execute(sa.select(runs.c.id, runs.c.spec).where(runs.c.status.in_(_NOT_DONE)))
    for run_id, spec in rows.all():
        resources = (spec or {}).get('resources') or {}
        if not resources.get('use_gpu'):
            continue
        gpus = math.ceil(
            int(resources.get('num_workers', 1)) * float(resources.get('gpus_per_worker') or 1)
            - 1e-6
        )
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(gpus=gpus))


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
