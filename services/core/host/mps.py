"""CUDA MPS for a fleet whose services share one GPU (`run.cuda_mps`, `rlfleet up` only).

Without MPS the kernels of different processes on one GPU time-slice: while the trainer's kernels
run, the engine's decode steps wait, however few SMs the trainer uses. Under an MPS control daemon
the processes' kernels run side by side. The launcher starts a daemon of its own, with its pipe and
log directories in a fresh temporary directory (a socket path must stay short), hands every service
that directory through the environment, and stops the daemon after the services: nothing outside
the fleet connects to it, and the GPU's settings are left as they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("rlfleet.mps")

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The MPS control daemon cannot be started or does not answer."""


class MpsDaemon:
    def __init__(self, root: Path, binary: str) -> None:
        self.root, self.binary = root, binary

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs to reach this daemon (and no other)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    def _control(self, *args: str, command: str | None = None, timeout_s: float = 10.0) -> str:
        try:
            out = subprocess.run([self.binary, *args], input=command, capture_output=True, text=True,
                                 env={**os.environ, **self.env}, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MpsError(f"{CONTROL} {' '.join(args) or command!r} did not answer within {timeout_s:g} s") from None
        if out.returncode != 0:
            why = (out.stderr or out.stdout).strip().splitlines()
            raise MpsError(f"{CONTROL} {' '.join(args) or repr(command)} failed (exit {out.returncode})"
                           + (f": {why[-1][:200]}" if why else ""))
        return out.stdout

    @classmethod
    def start(cls) -> MpsDaemon:
        binary = shutil.which(CONTROL)
        if binary is None:
            raise MpsError(f"run.cuda_mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver's"
                           " utilities); install it or set run.cuda_mps: false")
        root = Path(tempfile.mkdtemp(prefix="rlfleet-mps-"))
        for sub in ("pipe", "log"):
            (root / sub).mkdir()
        daemon = cls(root, binary)
        try:
            daemon._control("-d")  # forks the daemon and returns
        except MpsError:
            shutil.rmtree(root, ignore_errors=True)
            raise
        log.info("cuda mps daemon started", extra={"dir": str(root)})
        return daemon

    def quit_nowait(self) -> None:
        """`stop` for the launcher's hard exit: the quit is sent, nothing is waited for."""
        try:
            proc = subprocess.Popen([self.binary], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**os.environ, **self.env}, text=True)
            assert proc.stdin is not None
            proc.stdin.write("quit\n")
            proc.stdin.close()
        except OSError as err:
            log.warning("cuda mps daemon not told to quit", extra={"error": str(err)})

    def stop(self) -> None:
        """Ask the daemon to quit (its server exits once the last client has), then drop its directory.
        Bounded; a daemon that does not answer is reported, not waited for."""
        try:
            self._control(command="quit\n")
            log.info("cuda mps daemon stopped")
        except MpsError as err:
            log.warning("cuda mps daemon did not stop cleanly", extra={"error": str(err)})
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
