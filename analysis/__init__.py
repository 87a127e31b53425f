"""specproxy.analysis."""
