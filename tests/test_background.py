"""Start-up at SCHED_IDLE (diagnosis.host.Background), in a child process so
that pytest's own threads keep their scheduling."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from greyhound_bpf.diagnosis.host import Background
from greyhound_bpf.probe.discovery import threads_of

def policies():
    return sorted({os.sched_getscheduler(t) for t in threads_of(os.getpid())})

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()     # a thread from before
bg = Background(nice=5, max_s=float(sys.argv[2])).enter()
later = threading.Thread(target=stop.wait, daemon=True)      # one created while idle
later.start()
out = {"idle": policies(), "later": os.sched_getscheduler(later.native_id)}
if bg.max_s < 1:
    time.sleep(bg.max_s + 0.5)                                # the watchdog's turn
else:
    bg.restore()
bg.restore()                                                  # twice is harmless
main_tid = threading.main_thread().native_id
out.update(after=policies(), nice=os.getpriority(os.PRIO_PROCESS, main_tid),
           later_nice=os.getpriority(os.PRIO_PROCESS, later.native_id),
           timed_out=bg.timed_out)
print(json.dumps(out))
"""


def run_child(max_s: float) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(max_s)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_start_up_is_idle_then_restored_at_nice():
    got = run_child(20.0)
    # Every thread idle except the watchdog (SCHED_OTHER, so that it runs).
    assert got["idle"] == sorted({0, 5}) and got["later"] == 5, got    # OTHER=0, IDLE=5
    assert got["after"] == [0] and got["nice"] == 5 and got["later_nice"] == 5, got
    assert got["timed_out"] is False


def test_a_start_up_that_lasts_is_restored_by_the_watchdog():
    got = run_child(0.3)
    assert got["timed_out"] is True and got["after"] == [0] and got["nice"] == 5, got
