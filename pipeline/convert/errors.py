"""What can go wrong in a conversion as a whole, as the converters report it: a bad request
(ConversionError: one line, exit code 2) or a fault met on the way (ConversionFault: one line,
exit code 1). A single unusable image is neither: it is skipped (pipeline/convert/images.py)."""
from __future__ import annotations


class ConversionError(Exception):
    """A problem with the whole run (not one file): reported as one line, exit code 2."""


class ConversionFault(Exception):
    """A fault met on the way (a full disk, an I/O error): one line, exit code 1; the split being
    written leaves nothing behind, and what earlier runs wrote is untouched."""
