"""User-facing errors: raised for bad input, printed without a traceback by the CLI."""


class PimmError(Exception):
    """An error a person can fix: the message says what was wrong, the value seen, what to do."""


class ConfigError(PimmError):
    """A config file, name or override is wrong."""


class DataError(PimmError):
    """A data file is missing, unreadable or not a pimm event file."""


class LaunchError(PimmError):
    """The requested resources or launch options cannot work."""


class TrainingError(PimmError):
    """Training stopped on purpose (for example a non-finite loss)."""
