"""The one augmentation semantics: crop boxes and their seeds, ColOut, RandAugment, normalization into a batch."""
