"""``paradit serve``: ``launch`` -> ``server`` (FastAPI) -> ``scheduler`` -> ``Engine``; only ``launch`` imports it."""
