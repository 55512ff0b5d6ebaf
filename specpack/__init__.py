"""specpack: an LLM and its speculative-decoding drafter as one signed artifact."""

from specpack._version import FORMAT_NAME, FORMAT_VERSION, __version__

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "__version__", "load"]


def load(path, **kwargs):
    """Verify the artifact at `path`, then load it as one `SpecModel` (see `specpack.runtime.api`)."""
    from specpack.runtime.api import load as _load

    return _load(path, **kwargs)
