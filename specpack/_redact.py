"""Credentials never reach a log line or the terminal: `scheme://user:password@host` → `scheme://***@host`."""

from __future__ import annotations

import logging
import re

# the userinfo of a URL runs to its last '@' before the host's end ('/', '?', '#' or a blank), so
# a password with a raw '@' in it is hidden whole
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by `***`."""
    return _USERINFO.sub(r"\g<scheme>***@", str(text))


class RedactingFilter(logging.Filter):
    """A handler filter that redacts every record's final message (other libraries' too, e.g.
    the HTTP client's `HTTP Request: GET http://user:pw@…` lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True
