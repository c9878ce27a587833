"""The append service."""
