"""Counters, timings and the run report."""
