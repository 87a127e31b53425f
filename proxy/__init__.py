"""The proxy side of specproxy: the server in front of the arms, its calls to them, the span writer,
and replay.
"""
