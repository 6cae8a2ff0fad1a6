"""Settings of the router (env DAPO_*, or --flags): `python -m router --help` lists them."""

from __future__ import annotations

from pydantic import Field

from services.settings import RedisSettings, ServiceSettings


class RouterSettings(ServiceSettings, RedisSettings):
    port: int = Field(8010, ge=0, le=65535, description="HTTP port: the one OpenAI-compatible endpoint.")
    refresh_s: float = Field(
        1.0, gt=0, le=60, description="How often the replicas' heartbeats are read again (joins, leaves, load)."
    )
    call_timeout_s: float = Field(
        960.0,
        gt=0,
        description="One proxied call at most: above a replica's own limit (900 s), so the replica's answer to a call "
        "past it (a 503) reaches the client.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, le=60, description="Connecting to a replica's gateway at most.")
    max_connections: int = Field(512, ge=1, description="Connections to the replicas kept open at most.")
