"""Answer cache service: an exact tier in Redis and a semantic tier (MiniLM + Qdrant)."""
