"""The package version, in a module of its own so that parts of the package can name it
without importing the package root (which re-exports the probe)."""

__version__ = "0.1.0"
