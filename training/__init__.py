"""training package (filled in by later issues)."""
