"""The write service."""
