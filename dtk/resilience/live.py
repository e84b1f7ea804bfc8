"""A running launcher's control channel: loopback only, and only for whoever can read the run's token file
(`control.json`, mode 0600, in the run folder). `dtk inject-failure --run DIR kill:rank=1` speaks it."""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Callable

from dtk.errors import DtkError

TOKEN_FILE = "control.json"


class LiveControl:
    def __init__(self, run_dir: Path, handle: Callable[[list[str], list[str]], list[str]]):
        """`handle(specs, ids)` schedules faults, each under its id, and returns their normalized spellings, or raises
        DtkError. The ids are the channel's: live0, live1, ... across every request (one at a time), so that no two
        faults sent to a run share one."""
        self.path = Path(run_dir) / TOKEN_FILE
        self.handle = handle
        self.sent = 0
        self.token = secrets.token_hex(16)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"port": self.sock.getsockname()[1], "token": self.token, "pid": os.getpid()}, f)
        threading.Thread(target=self._serve, name="dtk-live-control", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    request = json.loads(conn.makefile().readline())
                    if not hmac.compare_digest(str(request.get("token", "")), self.token):
                        reply = {"ok": False, "error": "--run: the token does not match this run's control.json"}
                    else:
                        reply = {"ok": True, "scheduled": self._schedule(list(request.get("faults", [])))}
                except DtkError as e:
                    reply = {"ok": False, "error": "; ".join(e.lines)}
                except (ValueError, OSError) as e:
                    reply = {"ok": False, "error": f"bad request: {e}"}
                try:
                    conn.sendall((json.dumps(reply) + "\n").encode())
                except OSError:
                    pass

    def _schedule(self, specs: list[str]) -> list[str]:
        ids = [f"live{self.sent + i}" for i in range(len(specs))]
        self.sent += len(specs)  # a refused request's ids are spent too
        return self.handle(specs, ids)

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def send_faults(run_dir: str | Path, specs: list[str], *, timeout_s: float = 10.0) -> list[str]:
    """Ask the launcher of a running `dtk train` to inject faults; returns what it scheduled."""
    path = Path(run_dir) / TOKEN_FILE
    if not Path(run_dir).is_dir():
        raise DtkError(f"--run: got {str(run_dir)!r}; no such run folder")
    if not path.is_file():
        raise DtkError(f"--run: got {str(run_dir)!r}; no run is in progress there (no {TOKEN_FILE})")
    try:
        info = json.loads(path.read_text())
    except PermissionError:
        raise DtkError(f"--run: cannot read {path}; only the run's owner may inject faults") from None
    try:
        with socket.create_connection(("127.0.0.1", int(info["port"])), timeout=timeout_s) as s:
            s.sendall((json.dumps({"token": info["token"], "faults": specs}) + "\n").encode())
            reply = json.loads(s.makefile().readline() or "{}")
    except OSError:
        raise DtkError(f"--run: got {str(run_dir)!r}; its launcher does not answer (the run has ended?)") from None
    if not reply.get("ok"):
        raise DtkError(reply.get("error", "--run: the launcher refused the request"))
    return reply["scheduled"]
