"""``paradit serve``: ``launch`` -> ``server`` (the FastAPI app) -> ``scheduler`` -> ``paradit.Engine`` per group.
Nothing here imports torch.distributed; only ``launch`` imports the engine."""
