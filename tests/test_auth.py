"""Token configuration and bearer parsing (controller.auth), without HTTP."""

from __future__ import annotations

import json
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


def test_one_token_for_two_principals_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        Tokens(admin=["shared-secret"], nodes={"node-a": ["shared-secret"]})
    assert "shared-secret" not in str(info.value)
    with pytest.raises(ConfigError):
        Tokens(admin=[" "])


def test_tokens_from_env_and_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    toml_file = tmp_path / "tokens.toml"
    toml_file.write_text('admin = "file-admin"\n[nodes]\nnode-c = ["tc1", "tc2"]\n')
    toml_file.chmod(0o644)
    tokens = Tokens.from_env({
        "SCHED_ADMIN_TOKEN": "env-admin",
        "SCHED_NODE_TOKENS": " node-a=ta , node-b=tb ,",
        "SCHED_TOKENS_FILE": str(toml_file),
    })
    assert tokens.authenticate("env-admin") == tokens.authenticate("file-admin") == Principal(None)
    assert tokens.authenticate("ta") == Principal("node-a")
    assert tokens.authenticate("tc2") == Principal("node-c")
    assert "readable by other users" in caplog.text
    caplog.clear()
    toml_file.chmod(0o600)
    Tokens.from_env({"SCHED_TOKENS_FILE": str(toml_file)})
    assert "readable by other users" not in caplog.text

    json_file = tmp_path / "tokens.json"
    json_file.write_text(json.dumps({"admin": ["j-admin"], "nodes": {"node-j": "tj"}}))
    tokens = Tokens.from_env({"SCHED_TOKENS_FILE": str(json_file)})
    assert tokens.authenticate("tj") == Principal("node-j")
    assert tokens.authenticate("j-admin") == Principal(None)
    assert not Tokens.from_env({}).has_admin


@pytest.mark.parametrize(
    "content",
    ['admin = "x"\nextra = 1\n', 'admin = 3\n', 'admin = "secret-in-a-bad-line\n',
     '[nodes]\nnode-a = 5\n'],
)
def test_bad_tokens_file_is_a_config_error_without_its_text(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        Tokens.from_env({"SCHED_TOKENS_FILE": str(path)})
    assert "secret-in-a-bad-line" not in str(info.value)


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
