"""Launching real engines: `specproxy engines plan/up/status/down`, the vLLM command per arm, and each
arm's captured stack.
"""
