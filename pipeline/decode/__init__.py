"""Stored JPEGs to pixels: the batch decode engine (C), the crop-only ROI decoder, and the Pillow path."""
