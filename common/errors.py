"""Errors that the CLI reports as one clear paragraph (exit 2), without a traceback."""


class InputError(Exception):
    """Bad user input: a recipe, config, checkpoint or request. The message names what and where."""


class InternalError(RuntimeError):
    """A failure of the runtime itself, not of the request (an engine step failed, an invariant broke): the
    APIs answer 500 and log it with an error id, never a 4xx."""
