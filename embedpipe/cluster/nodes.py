"""A Ray node as embedpipe names it in its reports, logs and errors."""

from __future__ import annotations


def node_label(ip: str, node_id: str) -> str:
    """A Ray node as the report names it: "<ip>/<first 8 hex digits of its id>" (the id tells apart nodes
    that share an address, such as several nodes of one machine)."""
    return f"{ip}/{node_id[:8]}"


def node_name() -> str:
    """This process's Ray node (node_label); "" outside Ray."""
    import ray

    if not ray.is_initialized():
        return ""
    return node_label(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())
