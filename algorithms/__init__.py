"""algorithms package (filled in by later issues)."""
