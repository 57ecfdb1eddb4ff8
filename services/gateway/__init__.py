"""Gateway service: the public entry of the mesh."""
