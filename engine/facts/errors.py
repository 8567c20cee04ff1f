"""Errors a user can cause and fix. Their message is the whole story: the CLI prints it on one line and the
window shows it as is, so it says what went wrong and what to do, never a traceback."""


class EngineError(Exception):
    """Base class: anything the user can act on."""


class ModelSourceError(EngineError):
    """The model source cannot be resolved or loaded (missing path, broken file, offline hub id, ...)."""


class PromptError(EngineError):
    """The prompt cannot be run (empty, or longer than the model's context)."""


class ParameterError(EngineError, ValueError):
    """A generation parameter is out of range."""


class TraceError(EngineError):
    """A trace file cannot be read (empty, truncated, wrong version, not a trace)."""


class NonFiniteLogits(EngineError):
    """The model's next-token scores are not all numbers (NaN or infinity): its weights or its dtype are broken
    for this input, and no token can be chosen."""
