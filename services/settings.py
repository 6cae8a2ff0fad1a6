"""Settings: one pydantic-settings class per service, read from `DAPO_*` env vars and `--flags`.

A bad value stops the service at start-up with a message that names the setting. Secrets are
`SecretStr` and are redacted (as are passwords inside URLs) wherever settings are printed.

    class RewardSettings(ServiceSettings):
        port: int = Field(8001, ge=1, le=65535, description="HTTP port")
    settings = load_settings(RewardSettings, prog="python -m reward_server")
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Sequence
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict, SettingsError

S = TypeVar("S", bound="DapoSettings")

_URL_PASSWORD = re.compile(r"(?<=://)([^:/@]*):([^@/]+)@")


def redact_url(url: str) -> str:
    """redis://user:secret@host -> redis://user:***@host"""
    return _URL_PASSWORD.sub(r"\1:***@", url)


class DapoSettings(BaseSettings):
    """Base of every settings class: DAPO_ env prefix, kebab-case CLI flags, redaction."""

    model_config = SettingsConfigDict(
        env_prefix="DAPO_",
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        validate_default=True,
    )

    def redacted(self) -> dict[str, Any]:
        """The settings as JSON-able values, secrets and URL passwords replaced by stars."""
        out = self.model_dump(mode="json")  # SecretStr dumps as '**********'
        return {k: redact_url(v) if isinstance(v, str) and "://" in v else v for k, v in out.items()}

    def secret_values(self) -> list[str]:
        """The plain values of every secret, for the log filter that masks them."""
        values = [v.get_secret_value() for v in self.__dict__.values() if isinstance(v, SecretStr)]
        for v in self.__dict__.values():
            if isinstance(v, str) and (m := _URL_PASSWORD.search(v)):
                values.append(m.group(2))
        return [v for v in values if v]


class RedisSettings(DapoSettings):
    redis_url: str | None = Field(
        None,
        description="Redis URL, e.g. redis://127.0.0.1:6379/0. Unset: `dapo-mesh up` embeds one.",
    )
    redis_password: SecretStr | None = Field(None, description="Redis password (or put it in the URL).")
    redis_timeout_s: float = Field(10.0, gt=0, le=300, description="Timeout of every Redis socket wait.")
    redis_retries: int = Field(10, ge=0, le=100, description="Retries with backoff before Redis counts as down.")

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise SystemExit(
                "DAPO_REDIS_URL is not set: point it at the mesh's Redis (e.g. redis://127.0.0.1:6379/0), "
                "or start the whole mesh with `dapo-mesh up`, which runs an embedded Redis."
            )
        return self.redis_url


class ServiceSettings(DapoSettings):
    """What every HTTP service has: bind address, auth token, logging. Services that use Redis
    also inherit RedisSettings: `class BufferSettings(ServiceSettings, RedisSettings)`."""

    host: str = Field("127.0.0.1", description="Address to bind the HTTP server to.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    auth_token: SecretStr | None = Field(
        None, description="Bearer token required on every endpoint except /healthz. Unset: no auth."
    )
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond).")
    api_docs: bool = Field(False, description="Serve /openapi.json, /docs and /redoc (behind the token if one is set).")
    insecure: bool = Field(False, description="Allow a non-loopback bind address without an auth token.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_json: bool = Field(False, description="Log one JSON object per line (for log shippers).")

    @model_validator(mode="after")
    def _no_open_network_service(self) -> Self:
        if self.auth_token is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from the network and no auth token is set: set --auth-token "
                "(DAPO_AUTH_TOKEN), bind 127.0.0.1, or pass --insecure to serve without one"
            )
        return self


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; 0.0.0.0 and every other address are reachable from the network."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def secret_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The settings of `cls` whose values are secrets (`SecretStr`, optional or not): redacted wherever printed,
    never echoed in an error, never in a preset or on a command line."""
    return frozenset(n for n, f in cls.model_fields.items() if "SecretStr" in str(f.annotation))


def _setting_name(loc: tuple[Any, ...]) -> str:
    if not loc:  # a rule over several settings
        return "settings"
    field = str(loc[0])
    return f"{field} (env DAPO_{field.upper()}, flag --{field.replace('_', '-')})"


def load_settings(cls: type[S], argv: Sequence[str] | None = None, *, prog: str | None = None) -> S:
    """Parse env + CLI flags into `cls`; on a bad value print which setting and why, then exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return CliApp.run(cls, cli_args=args, cli_prog_name=prog)
    except ValidationError as e:
        secret = secret_fields(cls)
        lines = [
            f"  {_setting_name(x['loc'])}: {x['msg']}"
            + ("" if not x["loc"] or x["loc"][0] in secret else f" (got {x.get('input')!r})")
            for x in e.errors()
        ]
        sys.stderr.write(f"invalid settings for {prog or cls.__name__}:\n" + "\n".join(lines) + "\n")
        raise SystemExit(2) from None
    except SettingsError as e:
        sys.stderr.write(f"invalid settings for {prog or cls.__name__}: {e}\n")
        raise SystemExit(2) from None
