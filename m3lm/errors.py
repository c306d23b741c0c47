"""Exceptions raised for bad user input: configs, checkpoints, requests."""


class M3lmError(Exception):
    """Base class of every error m3lm reports to a user as a one-line message."""


class ConfigError(M3lmError, ValueError):
    """A config.json value that is missing, out of range or unsupported."""


class CheckpointError(M3lmError, ValueError):
    """A checkpoint directory or tensor that cannot be loaded as it is."""
