"""Start, kill and restart a local ``superfluid serve`` for tests and demos.

    from superfluid_client.daemon import Daemon

    with Daemon() as d:              # a temp sessions dir, a free port
        s = d.client().session()
        ...
        d.kill9(); d.start()         # SIGKILL, then the same dir and port again

The binary is ``SUPERFLUID_BIN``, else ``$CARGO_TARGET_DIR/debug/superfluid``,
else ``~/.cache/superfluid/target/debug/superfluid``; the model is
``SUPERFLUID_TEST_MODEL``, else the default SmolLM2 in
``~/.cache/superfluid/models``.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from . import Client, SuperfluidError

MODELS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "superfluid", "models")
DEFAULT_MODEL = os.path.join(MODELS_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")


def find_binary() -> str:
    """The superfluid binary: SUPERFLUID_BIN, $CARGO_TARGET_DIR/debug, or
    ~/.cache/superfluid/target/debug."""
    candidates = []
    if os.environ.get("SUPERFLUID_BIN"):
        return os.environ["SUPERFLUID_BIN"]
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "debug", "superfluid"))
    candidates.append(os.path.join(os.path.expanduser("~"), ".cache", "superfluid", "target", "debug", "superfluid"))
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("superfluid")
    if found:
        return found
    raise FileNotFoundError("no superfluid binary: set SUPERFLUID_BIN (tried {})".format(", ".join(candidates)))


def default_model() -> str:
    """SUPERFLUID_TEST_MODEL, else the default SmolLM2 model's path."""
    return os.environ.get("SUPERFLUID_TEST_MODEL") or DEFAULT_MODEL


def derived_model(name: str) -> str:
    """A test model beside the default one (e.g. SmolLM2-135M-tools-think.gguf)."""
    return os.path.join(os.path.dirname(default_model()), name)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """A ``superfluid serve`` with ``--web`` on a fixed port, so clients keep
    their URL across restarts. Its sessions dir, socket and output files live
    in ``dir`` (a temp dir unless given, removed by :meth:`cleanup`)."""

    def __init__(
        self,
        binary: Optional[str] = None,
        model: Optional[str] = None,
        dir: Optional[str] = None,
        port: Optional[int] = None,
        extra_args: Optional[List[str]] = None,
        env: Optional[Dict[str, str]] = None,
    ):
        self.binary = binary or find_binary()
        self.model = model or default_model()
        self._own_dir = dir is None
        self.dir = dir or tempfile.mkdtemp(prefix="sf-py-")
        os.makedirs(self.dir, exist_ok=True)
        self.sessions = os.path.join(self.dir, "sessions")
        self.socket = os.path.join(self.dir, "sf.sock")
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    @property
    def url(self) -> str:
        """The listener's URL."""
        return "http://127.0.0.1:{}".format(self.port)

    def token(self) -> str:
        """The token of the running daemon."""
        with open(os.path.join(self.sessions, "web-token")) as f:
            return f.read().strip()

    def client(self, timeout: float = 120.0) -> Client:
        """A Client that reads the token from this daemon's sessions dir
        (and again after a restart)."""
        return Client(self.url, sessions_dir=self.sessions, timeout=timeout)

    def log(self, name: str = "stderr") -> str:
        """The latest start's stdout or stderr."""
        try:
            with open(os.path.join(self.dir, "{}.{}".format(name, self.starts))) as f:
                return f.read()
        except OSError:
            return ""

    def start(self, timeout: float = 60.0) -> "Daemon":
        """Starts the daemon and waits until /web/rpc answers a ``List``."""
        assert self.proc is None, "already running"
        self.starts += 1
        out = open(os.path.join(self.dir, "stdout.{}".format(self.starts)), "w")
        err = open(os.path.join(self.dir, "stderr.{}".format(self.starts)), "w")
        args = [
            self.binary, "serve", self.model,
            "--sessions", self.sessions,
            "--socket", self.socket,
            "--web", "127.0.0.1:{}".format(self.port),
        ] + self.extra_args
        deadline = time.time() + timeout
        while True:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env={**os.environ, **self.env})
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if "listening on" in self.log("stdout"):
                        self.client(timeout=5).list()
                        out.close()
                        err.close()
                        return self
                except (SuperfluidError, OSError):
                    pass
                time.sleep(0.02)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                raise RuntimeError("the daemon did not answer within {}s:\n{}".format(timeout, self.log()))
            code = self.proc.returncode
            self.proc = None
            # The port or the socket may still be held for a moment after a kill.
            if time.time() >= deadline or "in use" not in self.log().lower():
                raise RuntimeError("the daemon exited during start ({}):\n{}".format(code, self.log()))
            time.sleep(0.2)

    def kill9(self) -> None:
        """SIGKILL, then reap."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM and wait; SIGKILL if it does not exit."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """SIGKILL and start again on the same dir and port."""
        self.kill9()
        self.start()

    def cleanup(self) -> None:
        """Stops the daemon and removes the temp dir it created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Daemon":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
