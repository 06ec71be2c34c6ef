"""Training data: the packed HDF5 token files (packed) and what training reads from them (batches: samplers,
windows, documents, packed rows, preference pairs)."""
