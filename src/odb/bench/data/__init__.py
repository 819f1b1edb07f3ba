"""Committed arrays of real token lengths (see scripts/make_lengths.py and odb.bench.realdata)."""
