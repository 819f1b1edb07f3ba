"""odb benchmarks: the main job of `make demo` (python -m odb.bench)."""
