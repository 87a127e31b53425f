"""The HTTP server that fronts the arms: routing (shadow or split), relaying, identity checks, and
`specproxy serve`.
"""
