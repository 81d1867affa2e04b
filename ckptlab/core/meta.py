"""The package version, in one place (records and run folders name it)."""

__version__ = "0.1.0"
