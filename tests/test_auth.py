"""Token configuration and bearer parsing (controller.auth), without HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.auth import Principal, Tokens, bearer_token, parse_node_tokens
from sched_core.errors import ConfigError


def test_tokens_authenticate_each_principal() -> None:
    tokens = Tokens(admin=["adm"], nodes={"node-a": ["ta", "ta-next"], "node-b": ["tb"]})
    assert tokens.authenticate("adm") == Principal(node=None)
    assert tokens.authenticate("ta") == Principal(node="node-a")
    assert tokens.authenticate("ta-next") == Principal(node="node-a")
    assert tokens.authenticate("tb") == Principal(node="node-b")
    for bad in ("", None, "ta ", "TA", "adm2", "tb\x00"):
        assert tokens.authenticate(bad) is None
    assert tokens.has_admin and tokens.nodes == ["node-a", "node-b"]
    assert not Tokens(nodes={"n": ["t"]}).has_admin
    assert Tokens(insecure=True).authenticate(None) == Principal(node=None)


def test_a_token_is_found_in_one_lookup_whatever_the_number_of_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 10,000 nodes' tokens compared one by one cost ~0.4 ms of CPU per request (twice
    # per pull): the presented token is hashed once and its digest looked up instead.
    import controller.auth as auth

    tokens = Tokens(admin=["adm-0123456789abcdef"],
                    nodes={f"n{i:05d}": [f"tok-{i:05d}-0123456789"] for i in range(10_000)})
    hashed: list[str] = []
    real_digest = auth._digest
    monkeypatch.setattr(auth, "_digest", lambda token: hashed.append(token) or real_digest(token))
    monkeypatch.setattr(auth.hmac, "compare_digest",
                        lambda *_: pytest.fail("no token is compared one by one"))
    assert tokens.authenticate("tok-09999-0123456789") == Principal(node="n09999")
    assert tokens.authenticate("adm-0123456789abcdef") == Principal(node=None)
    assert tokens.authenticate("tok-10000-0123456789") is None
    assert hashed == ["tok-09999-0123456789", "adm-0123456789abcdef", "tok-10000-0123456789"]
    # A reload puts the new table in force at once: a removed token is refused.
    tokens.replace_with(Tokens(admin=["adm-0123456789abcdef"]))
    assert tokens.authenticate("tok-09999-0123456789") is None
    assert tokens.authenticate("adm-0123456789abcdef") == Principal(node=None)
    assert tokens.nodes == []


def test_one_token_for_two_principals_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        Tokens(admin=["shared-secret"], nodes={"node-a": ["shared-secret"]})
    assert "shared-secret" not in str(info.value)
    with pytest.raises(ConfigError):
        Tokens(admin=[" "])


def test_tokens_from_env_and_files(tmp_path: Path) -> None:
    toml_file = tmp_path / "tokens.toml"
    toml_file.write_text('admin = "file-admin"\n[nodes]\nnode-c = ["tc1", "tc2"]\n')
    toml_file.chmod(0o600)
    tokens = Tokens.from_env({
        "SCHED_ADMIN_TOKEN": "env-admin",
        "SCHED_NODE_TOKENS": " node-a=ta , node-b=tb ,",
        "SCHED_TOKENS_FILE": str(toml_file),
    })
    assert tokens.authenticate("env-admin") == tokens.authenticate("file-admin") == Principal(None)
    assert tokens.authenticate("ta") == Principal("node-a")
    assert tokens.authenticate("tc2") == Principal("node-c")

    json_file = tmp_path / "tokens.json"
    json_file.write_text(json.dumps({"admin": ["j-admin"], "nodes": {"node-j": "tj"}}))
    json_file.chmod(0o600)
    tokens = Tokens.from_env({"SCHED_TOKENS_FILE": str(json_file)})
    assert tokens.authenticate("tj") == Principal("node-j")
    assert tokens.authenticate("j-admin") == Principal(None)
    assert not Tokens.from_env({}).has_admin


@pytest.mark.parametrize(("mode", "who"), [
    (0o644, "group may read, others may read"),
    (0o640, "group may read"),
    (0o620, "group may write"),
    (0o604, "others may read"),
    (0o602, "others may write"),
    (0o666, "group may read and write, others may read and write"),
])
def test_a_tokens_file_open_to_other_users_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    """Readable or writable by its group or anyone else: refused, saying who, naming the fix."""
    path = tmp_path / "tokens.toml"
    path.write_text('admin = "file-admin-secret"\n')
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        Tokens.from_env({"SCHED_TOKENS_FILE": str(path)})
    message = str(info.value)
    assert message == (f"tokens file {path} is open to other users ({who}; "
                       f"mode {mode:04o}): chmod 600 {path}")
    assert "file-admin-secret" not in message
    path.chmod(0o600)  # its owner only: accepted; execute bits do not matter
    assert Tokens.from_env({"SCHED_TOKENS_FILE": str(path)}).has_admin
    path.chmod(0o700)
    assert Tokens.from_env({"SCHED_TOKENS_FILE": str(path)}).has_admin


@pytest.mark.parametrize(
    "content",
    ['admin = "x"\nextra = 1\n', 'admin = 3\n', 'admin = "secret-in-a-bad-line\n',
     '[nodes]\nnode-a = 5\n'],
)
def test_bad_tokens_file_is_a_config_error_without_its_text(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(content)
    path.chmod(0o600)  # refused for its content, not its mode
    with pytest.raises(ConfigError) as info:
        Tokens.from_env({"SCHED_TOKENS_FILE": str(path)})
    assert "secret-in-a-bad-line" not in str(info.value)
    assert "other users" not in str(info.value)


def test_node_tokens_syntax_errors_do_not_echo_the_token() -> None:
    assert parse_node_tokens("a=1,b=2") == [("a", "1"), ("b", "2")]
    assert parse_node_tokens("a=x=y") == [("a", "x=y")]
    with pytest.raises(ConfigError) as info:
        parse_node_tokens("node-a=ok,just-a-secret")
    assert "just-a-secret" not in str(info.value)
    assert "item 2" in str(info.value)


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None),
     ("", None), (None, None)],
)
def test_bearer_token_parsing(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a tokens file as an operator should: a new file renamed over the old one."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    fresh.chmod(mode)
    fresh.replace(path)


def test_the_reloader_takes_a_changed_file_and_keeps_the_last_good_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from controller.auth import TokensReloader

    caplog.set_level(logging.INFO, logger="controller.auth")
    path = tmp_path / "tokens.toml"
    _write(path, 'admin = "adm-1"\n[nodes]\nnode-a = "na-1"\n')
    environ = {"SCHED_TOKENS_FILE": str(path), "SCHED_NODE_TOKENS": "node-e=ne-env"}
    tokens = Tokens.from_env(environ)
    reloader = TokensReloader(tokens, environ)
    assert reloader.check() is None  # unchanged

    _write(path, 'admin = "adm-2"\n[nodes]\nnode-a = ["na-1", "na-2"]\n')
    assert reloader.check() is True
    assert tokens.authenticate("adm-1") is None
    assert tokens.authenticate("adm-2") == Principal(None)
    assert tokens.authenticate("na-2") == Principal("node-a")
    assert tokens.authenticate("ne-env") == Principal("node-e")  # the environment's stay
    assert "tokens file reloaded" in caplog.text

    broken = [
        ('admin = "adm-3"\n[nodes\n', 0o600, "tokens file"),
        ('admin = "adm-3"\n', 0o644, "group may read, others may read"),
        ('[nodes]\nnode-a = "na-3"\n', 0o600, "no admin token left"),
        ('admin = "adm-3"\n[nodes]\nnode-a = "adm-3"\n', 0o600, "both admin and node:node-a"),
    ]
    for text, mode, why in broken:
        caplog.clear()
        _write(path, text, mode)
        assert reloader.check() is False, text
        # The last good tokens stay in force; the error names the file and why, not a token.
        assert tokens.authenticate("adm-2") == Principal(None)
        assert tokens.authenticate("adm-3") is None
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and str(path) in errors[0].getMessage(), caplog.text
        assert why in errors[0].getMessage() and "tokens in force are kept" in caplog.text
        assert "adm-3" not in caplog.text and "na-3" not in caplog.text
        assert reloader.check() is None  # an unchanged bad file is reported once
    path.unlink()
    assert reloader.check() is False and tokens.has_admin
    _write(path, 'admin = "adm-4"\n')
    assert reloader.check() is True
    assert tokens.authenticate("adm-4") == Principal(None)
    assert tokens.authenticate("adm-2") is None and tokens.authenticate("na-2") is None
    assert (reloader.reloads, reloader.failures) == (2, 5)


def test_the_reloader_thread_follows_the_file_and_a_request(tmp_path: Path) -> None:
    import time

    from controller.auth import TokensReloader

    path = tmp_path / "tokens.toml"
    _write(path, 'admin = "adm-1"\n')
    environ = {"SCHED_TOKENS_FILE": str(path)}
    tokens = Tokens.from_env(environ)

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.02)  # polling the live token set: no event to wait for

    with TokensReloader(tokens, environ, interval=0.1):
        _write(path, 'admin = "adm-2"\n')  # a change on disk: seen by the watcher
        until(lambda: tokens.authenticate("adm-2") is not None)
        assert tokens.authenticate("adm-1") is None
    # A request (what SIGHUP does) reloads at once even when the file looks unchanged.
    reloader = TokensReloader(tokens, environ, interval=3600)
    with reloader:
        reloader.request()
        until(lambda: reloader.reloads == 1)
    assert tokens.authenticate("adm-2") is not None
