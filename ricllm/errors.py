"""Errors a user can cause and fix. The CLI prints their message and exits non-zero, no traceback."""


class RicllmError(Exception):
    """Base of every error whose message is meant for the user."""


class ModelLoadError(RicllmError):
    """The model path, format, architecture or a tensor is not usable."""


class InvalidRequestError(RicllmError, ValueError):
    """A request is malformed (empty prompt, bad token id, bad sampling parameter)."""


class CapacityError(RicllmError, ValueError):
    """A request or a pin can never fit the KV budget or the model's context."""


class ConfigError(RicllmError, ValueError):
    """An engine setting is out of range."""
