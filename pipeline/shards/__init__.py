"""A WebDataset split as one indexed array of samples, each epoch's plan, and its batches from the engine or from workers."""
