"""openai jobs: what an OpenAI-style fine-tuning job was created with

Revision ID: 3f8a6c2e9b14
Revises: 7b2e4c9d1a30
Create Date: 2026-11-24 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '3f8a6c2e9b14'
down_revision: str | None = '7b2e4c9d1a30'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('openai_job', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('openai_job')
