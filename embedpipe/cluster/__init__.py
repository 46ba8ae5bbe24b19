"""Ray: the worker actor, the driver's first-come first-served queue, cluster join / local start."""
