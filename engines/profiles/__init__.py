"""Simulator cost profiles (JSON files, one per hardware x model)."""
