"""specproxy.proxy."""
