"""The span store writer: records become DuckDB rows on their own thread, and OTLP spans when export is
configured.
"""
