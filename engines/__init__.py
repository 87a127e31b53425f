"""specproxy.engines."""
