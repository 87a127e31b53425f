"""The span store's figures: what was measured per arm and level, where it came from, and whether
the machine kept up."""
