"""The C sources of the decode engine and the crop sampler, and their compilation into a per-user cache."""
