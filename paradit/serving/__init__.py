"""``paradit serve``: an OpenAI-style HTTP server over worker groups: ``launch`` -> ``server`` (the FastAPI app) ->
``scheduler`` (queue, groups, batching, timeouts, recovery) -> ``paradit.Engine`` per group (``docs/architecture.md``
says what the other modules hold). Nothing here imports torch.distributed; only ``launch`` imports the engine."""
