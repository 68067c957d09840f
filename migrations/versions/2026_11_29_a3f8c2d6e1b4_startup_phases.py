"""startup phases: an event's phase and duration (a startup_phase event's, and only its)

Revision ID: a3f8c2d6e1b4
Revises: e5d1a9c3f7b2
Create Date: 2026-11-29 12:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a3f8c2d6e1b4"
down_revision: str | None = "e5d1a9c3f7b2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("phase", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("duration_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_column("duration_seconds")
        batch_op.drop_column("phase")
