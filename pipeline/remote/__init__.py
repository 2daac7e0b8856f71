"""A converted dataset read from a URL: the block plan, the node's disk cache, the fetch process and blocks held in memory."""
