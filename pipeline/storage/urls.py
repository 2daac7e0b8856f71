"""Dataset URLs (s3://, gs://, http(s)://) as the rest of the code meets them: which paths are
URLs, how one is shown (credentials it carries are never printed), and the URL a client is given."""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("s3", "gs", "http", "https")
_SECRET_QUERY = re.compile(r"(sig|signature|token|credential|key|secret|password|auth)", re.I)


def is_url(path) -> bool:
    """True for a URL the loaders read; a plain (local) path is not a URL."""
    return isinstance(path, str) and urlsplit(path).scheme.lower() in SCHEMES and "://" in path


def redact(url: str) -> str:
    """The URL with user:password@ and secret-looking query values replaced by `***`; a local
    path as it is."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(
        f"{key}=***" if _SECRET_QUERY.search(key) else f"{key}={value}" if sep else key
        for key, sep, value in (item.partition("=") for item in parts.query.split("&") if item))
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def client_url(url: str) -> str:
    """The URL without the user and password it may carry, which `store_options` sends as a header."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])) if "@" in parts.netloc else url
