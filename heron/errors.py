"""Errors a user can cause. Each carries a message that says what to do; the CLI and server print only that."""


class HeronError(Exception):
    """Base class of heron's user-facing errors."""


class ConfigError(HeronError, ValueError):
    """An engine option heron cannot honour."""


class ModelLoadError(HeronError):
    """A model path, file or architecture heron cannot load."""


class InvalidRequestError(HeronError, ValueError):
    """A request with invalid parameters (HTTP 400). ``param`` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """A prompt (plus requested output) that does not fit the model's context (HTTP 400)."""


class EngineOverloadedError(HeronError):
    """The waiting queue is full; the client should retry later (HTTP 503)."""


class EngineDeadError(HeronError):
    """The engine loop stopped after an internal error (HTTP 500)."""


class WorkerDiedError(HeronError):
    """A tensor-parallel rank died (killed, out of memory, crashed): the engine cannot go on without it."""
