"""The vLLM-shaped simulator behind `specproxy sim`."""
