"""Calls to the arms: a lean HTTP/1.1 client, the SSE tap that measures each stream, and the /metrics
scraper.
"""
