"""Prompt data as Arrow tables: schemas, loading, records, prefix dedup, shards."""
