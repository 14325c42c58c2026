"""Error types whose messages are meant for users: what was wrong, the value, what to do."""


class KilnError(Exception):
    """Base of every error kiln reports to a user (the CLIs print it and exit with code 2)."""


class ConfigError(KilnError):
    """A build config key or value is not allowed."""


class CheckpointError(KilnError):
    """A checkpoint is missing, corrupt, or of an unsupported kind."""


class EngineError(KilnError):
    """An engine directory cannot be loaded as it is; the message says what to rebuild."""


class RequestError(KilnError):
    """A generation request is malformed or over the engine's built limits."""
