"""Weight transport: how the trainer's new weights reach the inference engines (docs/weight_sync.md)."""
