"""The pieces the mesh benchmarks share: load, bad inputs, the wire format, metric scrapes."""
