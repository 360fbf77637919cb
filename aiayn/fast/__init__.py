"""aiayn's speed, applied to a built model (being written)."""
