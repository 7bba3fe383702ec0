"""``paradit serve``: an OpenAI-style HTTP server over worker groups.

``launch`` (the command: engines, scheduler, uvicorn, draining on SIGTERM) -> ``server`` (FastAPI app: routes,
errors, auth, limits) -> ``scheduler`` (the queue, the groups, batching, cancellation, timeouts, recovery) ->
``paradit.Engine`` per group. Beside them: ``schemas`` (request and answer bodies), ``jobs`` (a request's life),
``videos`` (video jobs and their MP4s), ``media`` (image files), ``store`` (files served by address), ``metrics``
(Prometheus) and ``client`` (``paradit generate --server``).

Nothing here imports torch.distributed; only ``launch`` imports the engine.
"""
