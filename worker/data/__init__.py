"""A run's data: where it comes from, and how it is tokenized, packed, sharded and batched."""
