"""The errors a user can catch: both are ValueErrors, and both say what is wrong and what to do.

Kept in a base module (no imports) so that the engine, the loader and the settings raise the same
classes; the package root exports them.
"""


class SettingsError(ValueError):
    """A setting, a prompt or another argument of a call is not usable as given. `param` names the
    setting at fault where one is (the server answers it as OpenAI's error `param`)."""

    def __init__(self, message: str = "", param=None):
        super().__init__(message)
        self.param = param


class CheckpointError(ValueError):
    """A checkpoint's files are missing, malformed or inconsistent, or its weights are corrupt."""
