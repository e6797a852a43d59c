"""The REST adapter (FastAPI): read-mostly introspection, admin actions, metrics."""
