"""Listening addresses: which stay on this machine, and the warning every server of specpack's (its
own, or an engine it starts) gives when it listens beyond them without an API key."""

from __future__ import annotations

import ipaddress
import logging


def is_loopback(host: str) -> bool:
    """`host` reaches only this machine (a host name other than localhost may resolve to anything)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_without_key(log: logging.Logger, host: str) -> None:
    log.warning("serving on %s with no API key: anyone who can reach it can use the model; set "
                "--api-key or SPECPACK_API_KEY", host)
