"""At several ranks a failure is reported once: the first rank of a job to fail claims the report
(a file created exclusively, named by the job), and the ranks after it leave with their exit
status and no line, where each rank used to repeat the same line (a user error every rank sees,
or the peers of a failed rank reporting the collective it broke). Under torchrun (which names the
job: ``TORCHELASTIC_RUN_ID``) the ranks of one job on one host share the launcher (their parent
process, new for each job) and its rendezvous address; on several hosts each host reports once.
Ranks started another way each report. Standard library only: argparse errors come before the
slow imports.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

from torchrec_tpu.launcher import under_torchrun

STALE_S = 24 * 3600  # claims older than this are removed by the next claim


def _claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "torchrec-tpu-reports"


def _parent_start_time() -> str:
    """The launcher's start time in clock ticks (``/proc/PPID/stat`` field 22): with its pid, it
    names the launcher uniquely across pid reuse."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def job_key() -> str:
    """One name for all ranks of this job on this host, another for any other job (or restart)."""
    parts = [os.environ.get(name, "") for name in
             ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")]
    parts += [str(os.getppid()), _parent_start_time()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def claim_report() -> bool:
    """Whether this rank reports its failure: True for the first rank of the job to ask, and for
    it again (a process that runs several commands), and wherever no claim can be written (better
    twice than never) or no launcher names the job; False for the other ranks after it."""
    if not under_torchrun():  # no launcher that starts each job anew: no job to name
        return True
    claims = _claims_dir()
    claim = claims / job_key()
    try:
        claims.mkdir(exist_ok=True)
        _remove_stale(claims)
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return _claimed_by_this_process(claim)
    except OSError:
        return True
    with os.fdopen(fd, "w") as out:
        out.write(str(os.getpid()))
    return True


def _claimed_by_this_process(claim: Path) -> bool:
    try:
        return claim.read_text().strip() == str(os.getpid())
    except OSError:
        return False


def _remove_stale(claims: Path) -> None:
    now = time.time()
    for claim in claims.iterdir():
        try:
            if now - claim.stat().st_mtime > STALE_S:
                claim.unlink()
        except OSError:
            pass
