"""What the converters write and the loaders read: the manifest, a converted split's shards, the ImageNet folder layout."""
