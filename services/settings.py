"""Settings: one pydantic-settings class per service, read from `DAPO_*` env vars and `--flags`.

A bad value stops the service at start-up with a message that names the setting. Secrets are
`SecretStr` and are redacted (as are passwords inside URLs) wherever settings are printed. A secret is never
taken from the command line (`ps` shows every process's arguments to every user of the machine): it comes from
its environment variable (`DAPO_AUTH_TOKEN`) or from a file that variable names (`DAPO_AUTH_TOKEN_FILE=/run/secrets/
token`, as Docker and Kubernetes mount secrets); a secret flag stops the service with a message saying so.

    class RewardSettings(ServiceSettings):
        port: int = Field(8001, ge=1, le=65535, description="HTTP port")
    settings = load_settings(RewardSettings, prog="python -m reward_server")
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    CliApp,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

S = TypeVar("S", bound="DapoSettings")

_URL_PASSWORD = re.compile(r"(?<=://)([^:/@]*):([^@/]+)@")


def redact_url(url: str) -> str:
    """redis://user:secret@host -> redis://user:***@host"""
    return _URL_PASSWORD.sub(r"\1:***@", url)


def redact(value: Any) -> Any:
    """URL passwords replaced by stars in strings, at any depth of dicts and lists (SecretStr dumps as stars)."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else value
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


class SecretFiles(PydanticBaseSettingsSource):
    """Each secret setting from the file its `DAPO_<NAME>_FILE` variable names (the whole file, trailing newline
    removed; a mapping of secrets as a JSON object). The variable itself (`DAPO_<NAME>`) wins when both are set."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in secret_fields(self.settings_cls):
            path = os.environ.get(f"DAPO_{name.upper()}_FILE")
            if not path:
                continue
            try:
                text = Path(path).read_text().rstrip("\n")
            except OSError as e:
                raise SettingsError(f"DAPO_{name.upper()}_FILE={path}: cannot read it ({e.strerror})") from None
            out[name] = json.loads(text) if text.startswith("{") else text
        return out


class DapoSettings(BaseSettings):
    """Base of every settings class: DAPO_ env prefix, kebab-case CLI flags, secrets from the environment or from
    files, redaction."""

    model_config = SettingsConfigDict(
        env_prefix="DAPO_",
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        validate_default=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, dotenv_settings, SecretFiles(settings_cls), file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _empty_secret_is_unset(cls, data: Any) -> Any:
        """A secret given empty (compose's `DAPO_REWARD_TOKEN: ${DAPO_REWARD_TOKEN:-}`, a Secret key left blank) is
        unset: its role falls back to the auth token instead of expecting an empty bearer."""
        if isinstance(data, dict):
            names = secret_fields(cls)
            return {k: v for k, v in data.items() if not (k in names and v in ("", None))}
        return data

    def redacted(self) -> dict[str, Any]:
        """The settings as JSON-able values, secrets and URL passwords (at any depth) replaced by stars."""
        out: dict[str, Any] = redact(self.model_dump(mode="json"))
        return out

    def secret_values(self) -> list[str]:
        """The plain values of every secret (a mapping's too), for the log filter that masks them."""
        values: list[str] = []
        for v in self.__dict__.values():
            for x in v.values() if isinstance(v, dict) else [v]:
                if isinstance(x, SecretStr):
                    values.append(x.get_secret_value())
                elif isinstance(x, str) and (m := _URL_PASSWORD.search(x)):
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
        None,
        description="The mesh administration's bearer token: every endpoint but /healthz wants it, and the routes of "
        "a role whose own token is unset (reward, environments) take it instead. Unset: no auth (loopback only).",
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
    """The settings of `cls` whose values are secrets (`SecretStr`, optional or not, or a mapping of them):
    redacted wherever printed, never echoed in an error, never in a preset or on a command line."""
    return frozenset(n for n, f in cls.model_fields.items() if "SecretStr" in str(f.annotation))


def role_token(settings: BaseModel, field: str) -> SecretStr | None:
    """A role's credential: its own setting (`reward_token`, `env_token`, ...) or, unset, the mesh's auth token —
    so a mesh given `DAPO_AUTH_TOKEN` alone works, and each role's token can be set apart from it."""
    own = getattr(settings, field, None)
    return own if own is not None else getattr(settings, "auth_token", None)


def secret_flags(cls: type[BaseModel], argv: Sequence[str]) -> list[str]:
    """The secret settings `argv` gives as flags (`--auth-token T`, `--auth-token=T`): refused."""
    flags = {f"--{name.replace('_', '-')}": name for name in secret_fields(cls)}
    flags |= {f"--{name}": name for name in secret_fields(cls)}
    return sorted({flags[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in flags})


def _setting_name(loc: tuple[Any, ...]) -> str:
    if not loc:  # a rule over several settings
        return "settings"
    field = str(loc[0])
    return f"{field} (env DAPO_{field.upper()}, flag --{field.replace('_', '-')})"


def load_settings(cls: type[S], argv: Sequence[str] | None = None, *, prog: str | None = None) -> S:
    """Parse env + CLI flags into `cls`; on a bad value print which setting and why, then exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if given := secret_flags(cls, args):
        lines = [
            f"  --{n.replace('_', '-')}: set DAPO_{n.upper()} or DAPO_{n.upper()}_FILE (a file holding it)"
            for n in given
        ]
        sys.stderr.write(
            f"invalid settings for {prog or cls.__name__}: a secret is never given on the command line (every user "
            "of the machine can read it there):\n" + "\n".join(lines) + "\n"
        )
        raise SystemExit(2)
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
