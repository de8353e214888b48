"""The chaos soak: ``python -m soak --duration 180`` (see soak/README.md)."""
