"""The package's version, in a module of its own so that the recording side, the run file and the
reading side can name it without importing the package root (which imports them lazily)."""

__version__ = "0.1.0"
