"""The package's version and the artifact format it writes: the floor every room may read."""

__version__ = "0.1.0"

FORMAT_NAME = "specpack"
FORMAT_VERSION = 1
