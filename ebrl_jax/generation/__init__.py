"""Generation: policies (MLP, transformer with action chunks) and the act stage."""
