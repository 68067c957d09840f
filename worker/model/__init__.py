"""The model: loading it (partitioned under ZeRO-3), its LoRA adapters, checkpoints and the
final export."""
