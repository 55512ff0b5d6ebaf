"""specpack: an LLM and its speculative-decoding drafter as one signed artifact."""

__version__ = "0.1.0"

FORMAT_NAME = "specpack"
FORMAT_VERSION = 1


def load(path, **kwargs):
    """Verify the artifact at `path`, then load it as one `SpecModel` (see `specpack.runtime.api`)."""
    from specpack.runtime.api import load as _load

    return _load(path, **kwargs)
