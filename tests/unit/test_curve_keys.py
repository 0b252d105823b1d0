"""The control channel's keys (``pdstate.agent.curve``): derived from the token, or without one from
the uid's ``control.key``, which is made private and refused unless it is this uid's alone."""

from __future__ import annotations

import os

import pytest
import zmq

from pdstate.agent import curve
from pdstate.errors import ConfigError


def test_keys_derive_from_the_secret_alone():
    a, b = curve.derive_keys(b"t" * 32), curve.derive_keys(b"t" * 32)
    assert a == b and a != curve.derive_keys(b"u" * 32)
    assert a.server_public == zmq.curve_public(a.server_secret) and a.client_public == zmq.curve_public(a.client_secret)
    assert len({a.server_public, a.client_public}) == 2
    assert curve.control_keys(b"t" * 32, "/nonexistent/never-read") == a  # a token: no key file


def test_a_missing_key_is_made_private_and_kept(tmp_path):
    key_dir = tmp_path / "keys"
    key = curve.load_key(str(key_dir))
    assert len(key) == 32 and curve.load_key(str(key_dir)) == key
    assert os.stat(key_dir).st_mode & 0o777 == 0o700
    assert os.stat(key_dir / "control.key").st_mode & 0o777 == 0o600
    assert sorted(os.listdir(key_dir)) == ["control.key"]  # no temporary file left


def test_default_key_dir(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert curve.default_key_dir() == "/run/user/7/pdstate"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert curve.default_key_dir() == f"/tmp/pdstate-{os.getuid()}"


def _made(tmp_path):
    key_dir = tmp_path / "keys"
    curve.load_key(str(key_dir))
    return key_dir, key_dir / "control.key"


def test_a_key_open_to_others_is_refused(tmp_path):
    key_dir, path = _made(tmp_path)
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError) as err:
        curve.load_key(str(key_dir))
    assert str(err.value) == (
        f"auth.key_dir: key file {path} has mode 0640: group or others may open it; remove it, or make it yours "
        "with mode 0600; or set auth.key_dir"
    )
    os.chmod(path, 0o600)
    os.chmod(key_dir, 0o755)
    with pytest.raises(ConfigError) as err:
        curve.load_key(str(key_dir))
    assert str(err.value) == (
        f"auth.key_dir: directory {key_dir} has mode 0755: group or others may open it; remove it, or make it "
        "yours with mode 0700; or set auth.key_dir"
    )


def test_a_symlinked_or_foreign_key_is_refused(tmp_path):
    key_dir, path = _made(tmp_path)
    os.replace(path, key_dir / "elsewhere")
    os.symlink(key_dir / "elsewhere", path)
    with pytest.raises(ConfigError) as err:
        curve.load_key(str(key_dir))
    assert str(err.value) == (
        f"auth.key_dir: cannot open {path}: it is a symbolic link; remove it (it is made again on start)"
    )
    os.unlink(path)
    path.write_text("not a key\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as err:
        curve.load_key(str(key_dir))
    assert str(err.value) == (
        f"auth.key_dir: {path} does not hold a control key (64 hex digits); remove it (it is made again on start)"
    )
    if os.getuid() != 0:
        return  # only root can give the file to another uid
    os.unlink(path)
    curve.load_key(str(key_dir))
    os.chown(path, 65534, -1)
    with pytest.raises(ConfigError) as err:
        curve.load_key(str(key_dir))
    assert str(err.value) == (
        f"auth.key_dir: key file {path} is owned by uid 65534, not this user (uid 0); remove it, or make it "
        "yours with mode 0600; or set auth.key_dir"
    )
