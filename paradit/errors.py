"""Errors paradit reports: one line that names the problem and the allowed values."""


class ParaditError(Exception):
    """Base of every error the CLI prints as one line; it exits with ``exit_code``."""

    exit_code = 2  # bad input, something missing: what the user can change


class InvalidRequest(ParaditError, ValueError):
    """A request or setting that cannot be served as given; ``param``: the request's field at fault, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CheckpointError(ParaditError):
    """A checkpoint folder that is missing, incomplete or does not match the model."""


class NonFinitePrediction(ParaditError):
    """A denoise step predicted NaN or inf, which would decode to a black image: the request fails instead."""


class OutOfMemory(ParaditError):
    """The device ran out of memory: not the input's fault, so the CLI exits 1 and the server answers 503."""

    exit_code = 1


def report_warnings() -> None:
    """paradit's warnings as one line each on stderr, in every process of a run."""
    import logging

    logging.basicConfig(format="paradit: %(levelname)s: %(message)s", level=logging.WARNING)
