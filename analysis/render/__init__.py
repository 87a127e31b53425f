"""The verdicts as text (table, Markdown, CSV, JSON) and as the self-contained HTML report."""
