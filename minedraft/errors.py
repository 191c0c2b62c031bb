"""Errors a caller of minedraft can catch, each with one clear meaning."""


class MinedraftError(Exception):
    """Base class of every error minedraft raises on purpose."""

    code = "internal"


class InvalidRequestError(MinedraftError, ValueError):
    """The request itself is wrong (bad parameters, prompt too long, ...). Only it fails. `param` names the
    field it is about, where there is one (what an HTTP 400 reports as `param`)."""

    code = "invalid_request"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class OverloadedError(MinedraftError):
    """The engine's bounded queue is full; retry later."""

    code = "overloaded"


class EngineDeadError(MinedraftError):
    """A worker process died or the engine was shut down; every pending request fails with this."""

    code = "engine_dead"


class RequestAbortedError(MinedraftError):
    """The request was cancelled before it finished."""

    code = "aborted"


def check_text(text: str, what: str, param: str | None = None) -> str:
    """text, if it is valid Unicode; else InvalidRequestError. A lone UTF-16 surrogate ("\\ud800") is a Python
    str (JSON and the Python API can carry one) that no tokenizer or UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode text: a lone UTF-16 surrogate "
                                  f"(\\u{ord(text[e.start]):04x}) at character {e.start}", param) from None
    return text
