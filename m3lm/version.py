"""The version, in one place: pyproject.toml reads it, and `m3lm --version` prints it."""

__version__ = "0.1.0"
