"""Errors that the CLI reports as one clear paragraph (exit 2), without a traceback."""


class InputError(Exception):
    """Bad user input: a recipe, config, checkpoint or request. The message names what and where."""
