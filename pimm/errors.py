"""User-facing errors (printed without a traceback by the CLI) and pimm's exit statuses."""

EXIT_FAILED = 1  # training failed on some rank
EXIT_BAD_INPUT = 2  # found before any process started
EXIT_CHECKPOINTED = 75  # stopped by SIGTERM/SIGUSR1 after writing a complete checkpoint: resume it
EXIT_SECOND_SIGNAL = 76  # a second signal: exited at once, the last complete checkpoint is intact
EXIT_CHAIN_STOPPED = 78  # a Slurm chain job found no checkpoint progress since the previous job: the chain ends


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
