"""specproxy: measure, on real traffic, whether speculative decoding pays."""

__version__ = "0.1.0"
