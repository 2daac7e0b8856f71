"""Loader backends, one module each, imported only when asked for (see pipeline.build_loader)."""
