"""The mint service."""
