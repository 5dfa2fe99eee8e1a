"""Small helpers shared by tests: image comparison and a real `ditserve serve` process."""

from __future__ import annotations

import io
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from ditserve.cluster.cli import port_in_use


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 arrays (inf when equal)."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def png_pixels(data: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


def free_port() -> int:
    """A port free on every interface, picked below the kernel's ephemeral range.

    Ports handed out by ``bind(0)`` come from the ephemeral range, where Ray's own processes and every
    outgoing connection also take theirs; a port picked there can be gone by the time the server binds
    it. 20000-32767 sits above Ray's worker ports (10002-19999) and below the ephemeral range.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if all(port_in_use(host, port) is None for host in ("0.0.0.0", "::")):
            return port
    raise RuntimeError("no free port found in 20000-32767")


REPO_ROOT = Path(__file__).resolve().parents[1]


def user_env() -> dict[str, str]:
    """The environment for a ``ditserve`` command a test runs as a user would: this process's, without the
    Triton interpreter the test process turns on for its own kernel tests (tests/conftest.py). A CPU user's
    ``serve`` / ``generate`` run the LoRA path's torch implementation; interpreted, each adapted linear took
    about ten times as long (a 64x64 demo-flux step with an adapter: 4.6 s against 0.4 s). The kernels are
    checked against that implementation in this process (tests/kernels, tests/unit)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


class ServeProcess:
    """``ditserve serve`` in a subprocess on free ports; ``stop()`` sends Ctrl-C (SIGINT).

    Started as the README starts it: the ``ditserve`` console script, working directory at the repository
    root (Ray puts the driver's working directory on every worker's ``sys.path``, so a root folder that
    shadowed an installed distribution would break the replicas here).
    """

    def __init__(self, *args: str, timeout_s: float = 180.0, attempts: int = 3):
        # A port found free can still be taken before the server binds it; then start again on new ones.
        for attempt in range(attempts):
            try:
                self._start(args, timeout_s)
                return
            except RuntimeError as e:
                taken = any(m in str(e).lower() for m in ("choose another port", "failed to bind", "in use"))
                if attempt + 1 == attempts or not taken:
                    raise

    def _start(self, args: tuple[str, ...], timeout_s: float) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.log_path = Path(os.environ["DITSERVE_HOME"]) / f"serve-{self.port}.log"
        cmd = [str(Path(sys.executable).with_name("ditserve")), "serve", "--port", str(self.port)]
        cmd += ["--grpc-port", str(self.grpc_port), *args]
        self.log = open(self.log_path, "wb")
        # The server's output comes through a pipe: a thread copies each line to the log file as it arrives
        # and tells the moment the "serving" line does (the log file was read every 0.5 s before).
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
            env=user_env(),
        )
        self._serving: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._copier = threading.Thread(target=self._copy_output, name=f"serve-{self.port}-log", daemon=True)
        self._copier.start()
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                port = self._serving.get(timeout=min(left, 1.0))
            except queue.Empty:  # nothing said for a second: a process that left its output open may be gone
                if self.proc.poll() is None:
                    continue
                port = None
            if port is None:  # the output ended, or the process is gone, before it served
                self.proc.wait()
                self._copier.join(5)
                self.log.close()
                raise RuntimeError(f"ditserve serve exited early:\n{self.output()}")
            self.port = port  # with --address: the port Serve already listens on
            return
        self.stop()
        raise TimeoutError(f"ditserve serve did not start in {timeout_s}s:\n{self.output()}")

    def _copy_output(self) -> None:
        """The server's output, line by line, into the log file (until ``stop`` closes it; what comes after is
        read and dropped); the port of the "serving" line, then None at the end of the output, into
        ``self._serving``."""
        serving = re.compile(rb"ditserve: serving .+? at http://[^\s:]+:(\d+)/v1")
        told = False
        for line in iter(self.proc.stdout.readline, b""):
            try:
                self.log.write(line)
                self.log.flush()
            except ValueError:  # closed by stop()
                pass
            if not told and (match := serving.search(line)):
                self._serving.put(int(match.group(1)))
                told = True
        self.proc.stdout.close()
        self._serving.put(None)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._copier.join(5)  # the rest of its output (a process it left behind may still hold the pipe)
        self.log.close()
        return self.proc.returncode
