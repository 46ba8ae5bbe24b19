"""Readers and writers: Parquet units in, Parquet vector parts out."""
