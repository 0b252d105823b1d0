"""``pdstate probe``'s token: taken from a file or the environment (``--token`` warns that
``/proc`` shows it), sent only to the URLs given, never through a redirect.

Real ``pdstate probe`` processes against HTTP servers of the test on loopback: one that records
each request's headers, one that answers every request with a redirect to another host
(127.0.0.2, a recording server there). The probe runs with httpx and without it (the standard
library's urllib, which followed the redirect with the token: the case this used to leak).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.paths import REPO, SRC_DIR

TOKEN = "probe-token-8c2f41d07a5e"
WITHOUT_HTTPX = "import sys; sys.modules['httpx'] = None; from pdstate.cli import main; raise SystemExit(main())"


class Recorder(ThreadingHTTPServer):
    """Records ``(path, Authorization)`` of each request; answers ``redirect_to`` with 307, else
    ``/readyz`` not ready and ``/v1/compat`` 404."""

    daemon_threads = True

    def __init__(self, host: str, redirect_to: str | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.redirect_to = redirect_to
        super().__init__((host, 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        server: Recorder = self.server  # type: ignore[assignment]
        server.seen.append((self.path, self.headers.get("Authorization")))
        if server.redirect_to:
            self.send_response(307)
            self.send_header("Location", server.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"ready": False, "reason": "recorder"}).encode()
        self.send_response(200 if self.path == "/readyz" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def servers():
    other = Recorder("127.0.0.2")  # another host
    given = Recorder("127.0.0.1")
    redirecting = Recorder("127.0.0.1", redirect_to=other.url)
    yield given, redirecting, other
    for s in (given, redirecting, other):
        s.shutdown()
        s.server_close()


def probe(*args: str, httpx: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
    cmd = [sys.executable, "-m", "pdstate.cli"] if httpx else [sys.executable, "-c", WITHOUT_HTTPX]
    return subprocess.run(
        [*cmd, "probe", *args, "--timeout", "5"],
        env={**base, "PYTHONPATH": str(SRC_DIR), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("httpx", [True, False], ids=["httpx", "urllib"])
def test_a_redirect_to_another_host_is_never_followed_with_the_token(servers, token_file, httpx):
    _, redirecting, other = servers
    proc = probe(redirecting.url, "--token-file", str(token_file), "--json", httpx=httpx)
    assert proc.returncode == 1, proc.stderr  # not ready: the 307 is the worker's answer
    assert redirecting.seen and all(auth == f"Bearer {TOKEN}" for _, auth in redirecting.seen)
    assert other.seen == []  # was (urllib): GET /readyz with the token, at the other host
    (worker,) = json.loads(proc.stdout)["workers"]
    assert worker["ready"]["ready"] is False


@pytest.mark.parametrize(
    ("how", "env"),
    [
        ("file", None),
        ("env-file", "PDSTATE_AUTH__TOKEN_FILE"),
        ("env", "PDSTATE_AUTH__TOKEN"),
    ],
)
def test_the_token_comes_from_a_file_or_the_environment(servers, token_file, how, env):
    given, _, _ = servers
    args = ["--token-file", str(token_file)] if how == "file" else []
    value = {"PDSTATE_AUTH__TOKEN_FILE": str(token_file), "PDSTATE_AUTH__TOKEN": TOKEN}.get(env or "")
    proc = probe(given.url, *args, env={env: value} if env else None)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert [p for p, _ in given.seen] == ["/readyz", "/v1/compat"]
    assert {auth for _, auth in given.seen} == {f"Bearer {TOKEN}"}
    assert TOKEN not in " ".join(proc.args)  # never on the command line


def test_a_token_on_the_command_line_still_works_with_a_warning(servers):
    given, _, _ = servers
    proc = probe(given.url, "--token", TOKEN)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "pdstate probe: --token is visible to every user of this host (/proc/PID/cmdline); "
        "use --token-file FILE or PDSTATE_AUTH__TOKEN instead"
    ]
    assert {auth for _, auth in given.seen} == {f"Bearer {TOKEN}"}


def test_a_token_file_others_can_read_is_refused_before_anything_is_sent(servers, token_file):
    given, _, _ = servers
    token_file.chmod(0o644)
    proc = probe(given.url, "--token-file", str(token_file))
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        [f"pdstate: --token-file: {token_file} is accessible to other users (mode 0644); chmod 600 {token_file}"],
    )
    assert given.seen == []
