"""Errors meant for users: the CLI prints their message as one sentence, never a traceback."""


class UserError(Exception):
    """Bad input, a missing file, an impossible configuration: something the user can fix. The CLI exits with
    ``exit_code``; a subclass that reports a verdict rather than a failure (compare's unmet ``--require``) sets its
    own."""

    exit_code = 1
