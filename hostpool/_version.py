"""The version of this package (`hostpool.__version__`, `hostpool_build_info`)."""

__version__ = "0.1.0"
