"""Errors meant for users: the CLI prints their message as one sentence, never a traceback."""


class UserError(Exception):
    """Bad input, a missing file, an impossible configuration: something the user can fix."""
