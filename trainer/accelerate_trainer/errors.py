"""The one error every config check raises. No logic here."""


class ConfigError(ValueError):
    """The accelerate config is invalid; the message names the key and the fix."""
