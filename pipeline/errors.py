"""The errors a loader raises about its data, each one line naming the path or URL: what every
layer of the package may raise and the training entry point reports without a traceback."""
from __future__ import annotations


class DatasetError(ValueError):
    """The data a loader was pointed at is missing, incomplete or of the wrong kind."""


class CorruptSample(DatasetError):
    """A stored sample that cannot be decoded; the message names it."""


FAILS_CHECKSUM = "its bytes fail the checksum recorded at conversion"    # said of a damaged sample, wherever checked


class RemoteDataError(DatasetError):
    """Data in object storage or behind HTTP(S) that cannot be read; the message is one line
    naming the URL with any credentials redacted."""
