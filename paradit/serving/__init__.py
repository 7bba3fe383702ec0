"""``paradit serve``: ``launch`` -> ``server`` (FastAPI) -> ``scheduler`` -> ``Engine``; only ``launch`` imports it.
``ray_app``: the same server as Ray Serve replicas (``ray_serve``), for ``serve run`` and Serve config files."""

from __future__ import annotations

from typing import Any


def ray_app(args: dict[str, Any] | None = None, **options: Any):
    """The Ray Serve application of ``paradit serve --ray``: ``serve run paradit.serving:ray_app model=flux2-dev
    replicas=2 gpus_per_replica=4``, or a config file's ``import_path: paradit.serving:ray_app`` with those ``args``.
    Each name is a ``paradit serve`` option's (``max_batch`` for ``--max-batch``), parsed as its flag: a list repeats
    the flag, true gives a switch alone."""
    from paradit.cli import build_parser, serve_settings
    from paradit.errors import InvalidRequest
    from paradit.serving.ray_serve import application

    argv = ["serve", "--ray"]  # the cluster is the one `serve run` (or the caller) connected to
    for name, value in {**(args or {}), **options}.items():
        flag = "--" + name.replace("_", "-")
        for each in value if isinstance(value, list | tuple) else [value]:
            argv += [flag] if each is True else [flag, str(each)]
    try:
        parsed = build_parser().parse_args(argv)
    except SystemExit:  # argparse printed the problem
        raise InvalidRequest(f"ray_app's arguments are not paradit serve's options: {' '.join(argv[1:])}") from None
    return application(serve_settings(parsed))
