"""run result: why a run stopped and its best checkpoint by the chosen metric

Revision ID: 9d4e1f6a2c57
Revises: 3f8a6c2e9b14
Create Date: 2026-11-24 22:15:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '9d4e1f6a2c57'
down_revision: str | None = '3f8a6c2e9b14'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('result', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('result')
