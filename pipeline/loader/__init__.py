"""What every loader backend is built from: the base class (epochs, exact resume), the sharding rule, DataLoader workers, a prefetch ring."""
