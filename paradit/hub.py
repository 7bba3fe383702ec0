"""Whether the hub answers, asked once, quickly: unreachable, huggingface_hub retries each request for half a minute."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

# Long enough for a distant hub to answer a HEAD request, short enough that offline a refusal comes within 3 s.
PROBE_SECONDS = 2.0


def hub_offline() -> bool:
    """Whether huggingface_hub may read only its cache (asked once a process: a server resolves its models at start)."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or not _answers(constants.ENDPOINT)


@functools.cache
def _answers(endpoint: str) -> bool:
    import httpx2
    from huggingface_hub import get_session

    answered = threading.Event()

    def ask() -> None:
        with contextlib.suppress(httpx2.HTTPError):
            get_session().head(endpoint, timeout=PROBE_SECONDS)  # any status: something answered
            answered.set()

    # In a thread: the request's timeout does not bound a name lookup that hangs, the join does.
    probe = threading.Thread(target=ask, daemon=True)
    probe.start()
    probe.join(PROBE_SECONDS + 0.5)
    return answered.is_set()


def offline_reason() -> str:
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"the hub at {constants.ENDPOINT} is unreachable"


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """Silenced: huggingface_hub's retries warn twice each, and the error they end in says it once."""
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_log.setLevel(level)
