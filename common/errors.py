"""The error hierarchy. Every error of ours is a `MoeExportError`; the entry points map the kinds to answers:

InputError      bad user input (a recipe, config, checkpoint or request): exit 2 / HTTP 4xx, one paragraph naming what
                and where, no traceback.
BuildError      a build stage failed for a reason other than bad input (disk full, a library error): exit 1.
InternalError   a failure of the runtime itself, not of the request (an engine step failed, an invariant broke): the
                APIs answer 500 and log it with an error id, never a 4xx.
RequestFailed   an InternalError confined to one request: that request ends with it, the engine goes on serving.
EngineDead      an InternalError that left the engine core unusable: every open and later request ends with it, health
                checks fail and a server exits non-zero so that its supervisor restarts it.
"""


class MoeExportError(Exception):
    """Base of every error moe-export raises on purpose."""


class InputError(MoeExportError):
    """Bad user input: a recipe, config, checkpoint or request. The message names what and where."""


class BuildError(MoeExportError):
    """A build stage failed for a reason other than bad input (disk full, a library error); exit 1."""


class InternalError(MoeExportError, RuntimeError):
    """A failure of the runtime itself, not of the request: the APIs answer 500 and log it with an error id."""


class RequestFailed(InternalError):
    """One request failed inside the engine (its sampling row, grammar, detokenization or its share of a failed step);
    the engine core released its resources and serves the others."""


class EngineDead(InternalError):
    """The engine core can no longer run (repeated step failures, a lost rank): every open and later request ends with
    this error."""
