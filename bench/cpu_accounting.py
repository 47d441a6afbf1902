"""The CPU seconds of every thread of a command and of every process it starts, from ``/proc`` (Linux).

Answers where a run's CPU went when the parts run in several threads and processes (``moco index``: the
encoder's lanes, the decode processes under their fork server, the records thread, the main loop), which
``/usr/bin/time`` cannot (it counts only the children it waits for; the decoders are the fork server's). The
command runs in a session of its own; every 0.2 s each thread of each process of that session is read
(``utime + stime``), and the last reading of each is kept, so a thread that ends loses at most 0.2 s.

    python bench/cpu_accounting.py --out bench/results/X.json -- moco index DIR --out OUT --no-progress
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2


def _after_comm(stat: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` line after its ``(comm)`` (which may hold spaces)."""
    return stat[stat.rindex(")") + 2 :].split()


def read_threads(session: int) -> dict[tuple[int, int], dict]:
    """``(pid, tid) -> {command, cpu_s}`` of every thread of every process in ``session``, now."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_after_comm(Path(f"/proc/{pid}/stat").read_text())[3]) != session:
                continue
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                fields = _after_comm(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
                out[(int(pid), int(tid))] = {"command": command, "cpu_s": (int(fields[11]) + int(fields[12])) / TICKS}
        except (FileNotFoundError, ProcessLookupError, ValueError):  # ended between the listing and the read
            continue
    return out


def account(cmd: list[str], **popen) -> dict:
    """Run ``cmd`` to its end (``popen``: more ``subprocess.Popen`` arguments, such as ``cwd``, ``env`` or a file
    for ``stdout``); its wall time and the CPU seconds of each thread (largest first)."""
    popen = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **popen}
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    last: dict[tuple[int, int], dict] = {}
    while proc.poll() is None:
        last.update(read_threads(proc.pid))
        time.sleep(SAMPLE_S)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
    threads = sorted(
        ({"pid": pid, "tid": tid, "main_thread": pid == tid, **row} for (pid, tid), row in last.items()),
        key=lambda r: -r["cpu_s"],
    )
    total = sum(t["cpu_s"] for t in threads)
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 2),
        "cpu_s": round(total, 2),
        "cores_busy": round(total / wall, 2),
        "threads": [dict(t, cpu_s=round(t["cpu_s"], 2)) for t in threads if t["cpu_s"] >= 0.05],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command to run after --")
    result = {"benchmark": "cpu_accounting", "machine": machine(), "cores": os.cpu_count(), **account(cmd)}
    for t in result["threads"]:
        print(f"{t['pid']:>8} {t['tid']:>8} {t['cpu_s']:7.2f}  {t['command'][:70]}")
    print(f"wall {result['wall_s']} s, {result['cpu_s']} CPU-seconds, {result['cores_busy']} cores busy")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
