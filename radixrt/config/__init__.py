"""Shared settings: ServerArgs (every runtime flag), the tenants file, where generated artifacts are cached."""
