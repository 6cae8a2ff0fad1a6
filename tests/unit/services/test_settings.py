"""Settings: env + CLI flags, clear start-up errors, secrets redacted everywhere they are printed."""

from __future__ import annotations

import io
import logging

import pytest
from pydantic import Field

from services.logs import SecretMask
from services.settings import RedisSettings, ServiceSettings, load_settings, redact_url


class DemoSettings(ServiceSettings, RedisSettings):
    port: int = Field(8123, ge=1, le=65535)
    max_staleness: int = Field(4, ge=0, description="versions")


def test_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAPO_MAX_STALENESS", "2")
    monkeypatch.setenv("DAPO_PORT", "9000")
    s = load_settings(DemoSettings, ["--port", "9001", "--host", "127.0.0.2"])
    assert (s.host, s.port, s.max_staleness) == ("127.0.0.2", 9001, 2)  # flag beats env beats default


def test_a_network_address_without_a_token_refuses_to_start(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        with pytest.raises(SystemExit) as e:
            load_settings(DemoSettings, ["--host", host], prog="demo")
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"host {host!r} is reachable from the network and no auth token is set" in err and "--insecure" in err
    assert load_settings(DemoSettings, ["--host", "0.0.0.0", "--insecure"]).insecure is True
    monkeypatch.setenv("DAPO_AUTH_TOKEN", "t")
    assert load_settings(DemoSettings, ["--host", "0.0.0.0"]).host == "0.0.0.0"
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost"):
        assert load_settings(DemoSettings, ["--host", host]).host == host


def test_bad_value_exits_with_the_setting_named(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("DAPO_MAX_STALENESS", "-1")
    with pytest.raises(SystemExit) as e:
        load_settings(DemoSettings, [], prog="demo")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "max_staleness (env DAPO_MAX_STALENESS, flag --max-staleness)" in err
    assert "greater than or equal to 0" in err


def test_secrets_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAPO_AUTH_TOKEN", "tok-very-secret")
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://:hunter2pw@redis:6379/0")
    s = load_settings(DemoSettings, [])
    shown = s.redacted()
    assert "tok-very-secret" not in repr(shown) and "hunter2pw" not in repr(shown)
    assert shown["redis_url"] == "redis://:***@redis:6379/0"
    assert sorted(s.secret_values()) == ["hunter2pw", "tok-very-secret"]
    assert "tok-very-secret" not in repr(s) and "tok-very-secret" not in str(s)


def test_redact_url_forms() -> None:
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_log_filter_masks_secret_values() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(SecretMask(["hunter2pw"]))
    logger = logging.getLogger("test.mask")
    logger.addHandler(handler)
    logger.propagate = False
    logger.warning("connecting to %s", "redis://:hunter2pw@h")
    assert "hunter2pw" not in buf.getvalue() and "redis://:***@h" in buf.getvalue()


def test_a_secret_on_the_command_line_is_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    for argv in (["--auth-token", "t"], ["--auth-token=t"], ["--port", "9", "--redis-password", "pw"]):
        with pytest.raises(SystemExit) as e:
            load_settings(DemoSettings, argv, prog="demo")
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "a secret is never given on the command line" in err and "_FILE" in err
        assert "DAPO_AUTH_TOKEN" in err or "DAPO_REDIS_PASSWORD" in err


def test_a_secret_from_the_file_its_variable_names(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "token").write_text("from-a-file\n")
    monkeypatch.setenv("DAPO_AUTH_TOKEN_FILE", str(tmp_path / "token"))
    s = load_settings(DemoSettings, [])
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "from-a-file"
    assert "from-a-file" in s.secret_values() and "from-a-file" not in repr(s.redacted())
    monkeypatch.setenv("DAPO_AUTH_TOKEN", "from-the-variable")  # the variable itself wins
    assert load_settings(DemoSettings, []).auth_token.get_secret_value() == "from-the-variable"  # type: ignore[union-attr]
    monkeypatch.delenv("DAPO_AUTH_TOKEN")
    monkeypatch.setenv("DAPO_AUTH_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):
        load_settings(DemoSettings, [], prog="demo")
    assert "DAPO_AUTH_TOKEN_FILE" in capsys.readouterr().err


def test_a_role_falls_back_to_the_auth_token_until_it_has_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from reward_server.settings import RewardSettings
    from services.settings import role_token

    monkeypatch.setenv("DAPO_AUTH_TOKEN", "admin")
    s = load_settings(RewardSettings, [])
    assert role_token(s, "reward_token").get_secret_value() == "admin"  # type: ignore[union-attr]
    monkeypatch.setenv("DAPO_REWARD_TOKEN", "scores")
    s = load_settings(RewardSettings, [])
    assert role_token(s, "reward_token").get_secret_value() == "scores"  # type: ignore[union-attr]
