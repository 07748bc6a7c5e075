"""`tuneboard webui` flags: refuse a non-loopback host without a login; next free port when taken."""
import socket

import pytest

from webui import app


def test_refuses_public_host_without_auth(capsys):
    assert app.main(["--host", "0.0.0.0"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err


def test_auth_parsing(tmp_path):
    f = tmp_path / "users"
    f.write_text("# team\nann:pw1\nbob:pw2\n")
    opts = app.parse_args(["--auth", "me:secret", "--auth-file", str(f)])
    assert app.read_auth(opts) == [("me", "secret"), ("ann", "pw1"), ("bob", "pw2")]
    with pytest.raises(SystemExit, match="USER:PASS"):
        app.read_auth(app.parse_args(["--auth", "nopassword"]))


def test_next_free_port_when_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert app.free_port("127.0.0.1", taken) > taken
