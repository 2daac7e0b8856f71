"""pipeline package (filled in by later issues)."""
