"""SQLAlchemy adapter for belay (enqueue on a Session's transaction, Alembic
helper). Arrives with its own issue; the core works without it."""
