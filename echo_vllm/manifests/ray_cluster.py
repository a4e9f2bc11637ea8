"""How many GPUs the Ray cluster that `vllm serve --distributed-executor-backend ray` will use has (serve.sh)."""

from __future__ import annotations

import os
from pathlib import Path


def _gcs_address(address: str) -> str | None:
    """host:port that `ray.init(address)` would dial, when it can be told without Ray."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    return current.read_text().strip() if current.is_file() else None


def ray_gpus(address: str = "auto", connect_timeout: float = 10.0) -> float:
    """Total GPUs that the Ray cluster at `address` reports. Fails fast when nothing listens there (ray.init
    itself keeps retrying for minutes)."""
    import socket

    gcs = _gcs_address(address)
    if gcs is None:
        raise ConnectionError("no running Ray cluster found on this node (start-head.sh first, or set RAY_ADDRESS)")
    host, _, port = gcs.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=connect_timeout).close()
    except (OSError, ValueError) as err:
        raise ConnectionError(f"nothing answers at {gcs}: {err}") from None

    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()
