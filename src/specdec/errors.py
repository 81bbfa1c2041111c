"""The one exception type users see: a clear message, never a traceback."""


class SpecdecError(ValueError):
    """Bad input or an unusable resource, with a message meant for the user."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) that stopped a command with something to say (e.g. where its state was saved)."""
