"""`greyhound-trace check`: can tracing work on this machine, and if not, why.

Each check returns a Row; a failing row carries the exact command that fixes
it. Exit status 0 means `attach` can work (warnings allowed), 1 means it
cannot.
"""
from __future__ import annotations

import gzip
import os
import platform
from dataclasses import dataclass

from .catalog import Catalog, load_catalog
from .discovery import Discovery, job_roots, read_stat, widened_note

OK, WARN, FAIL = "ok", "warn", "FAIL"
SETUP = "sudo scripts/setup"


@dataclass
class Row:
    name: str
    status: str
    detail: str
    fix: str = ""


def kernel_config() -> dict[str, str] | None:
    release = platform.release()
    for path in ("/proc/config.gz", f"/boot/config-{release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as fh:
                cfg = {}
                for line in fh:
                    if line.startswith("CONFIG_"):
                        k, _, v = line.strip().partition("=")
                        cfg[k] = v
                return cfg
        except OSError:
            continue
    return None


def has_bpf_privileges() -> bool:
    if os.geteuid() == 0:
        return True
    # CAP_SYS_ADMIN (21), CAP_PERFMON (38) and CAP_BPF (39) together suffice.
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return all(caps >> bit & 1 for bit in (21, 38, 39))
    except OSError:
        pass
    return False


def check_kernel() -> list[Row]:
    cfg = kernel_config()
    rows = []
    needed = [("CONFIG_UPROBES", "uprobes"), ("CONFIG_UPROBE_EVENTS", "uprobe events"),
              ("CONFIG_BPF_SYSCALL", "bpf()"), ("CONFIG_BPF_EVENTS", "BPF on trace events")]
    if cfg is None:
        pmu = os.path.exists("/sys/bus/event_source/devices/uprobe/type")
        rows.append(Row("kernel: uprobes + BPF", OK if pmu else WARN,
                        "no kernel config to read; uprobe PMU " + ("present" if pmu else "absent"),
                        "" if pmu else "use a kernel with CONFIG_UPROBES=y, CONFIG_BPF_EVENTS=y"))
    else:
        missing = [k for k, _ in needed if cfg.get(k) != "y"]
        rows.append(Row("kernel: uprobes + BPF", FAIL if missing else OK,
                        "missing " + ", ".join(missing) if missing else
                        " ".join(f"{k.removeprefix('CONFIG_')}=y" for k, _ in needed),
                        "rebuild the kernel with " + ", ".join(f"{k}=y" for k in missing)
                        if missing else ""))
        if cfg.get("CONFIG_KPROBES") != "y":
            rows.append(Row("kernel: kprobes", OK, "not enabled (not needed: uprobes only)"))
    btf = os.path.exists("/sys/kernel/btf/vmlinux")
    rows.append(Row("kernel: BTF", OK if btf else WARN,
                    "/sys/kernel/btf/vmlinux" if btf else "no /sys/kernel/btf/vmlinux",
                    "" if btf else "not needed by greyhound's probes; CONFIG_DEBUG_INFO_BTF=y "
                                   "gives other BPF tools CO-RE"))
    return rows


def check_tracefs() -> Row:
    for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(f"{d}/uprobe_events"):
            return Row("tracefs", OK, d)
    return Row("tracefs", FAIL, "not mounted (BCC needs it to detach uprobes cleanly)",
               "sudo mount -t tracefs nodev /sys/kernel/tracing")


def check_headers() -> Row:
    release = platform.release()
    build = f"/lib/modules/{release}/build"
    if not os.path.exists(f"{build}/include"):
        return Row("kernel headers", FAIL, f"{build} missing (BCC compiles against them)",
                   f"{SETUP}   # installs linux-headers-amd64 and links {build}")
    real = os.path.realpath(build)
    if release in os.path.basename(real):
        return Row("kernel headers", OK, f"{real} (the running kernel's)")
    return Row("kernel headers", OK,
               f"substitute: {real} for {release} (fine for uprobes: x86_64 pt_regs is stable)")


def check_bcc() -> Row:
    try:
        import bcc
    except ImportError as e:
        return Row("bcc", FAIL, f"cannot import bcc: {e}",
                   f"{SETUP}   # apt python3-bpfcc; venv with --system-site-packages")
    ver = getattr(getattr(bcc, "version", None), "__version__", "?")
    return Row("bcc", OK, f"{ver} ({os.path.dirname(bcc.__file__)})")


def check_privileges() -> Row:
    if has_bpf_privileges():
        return Row("privileges", OK, "root" if os.geteuid() == 0 else "CAP_BPF+CAP_PERFMON+CAP_SYS_ADMIN")
    return Row("privileges", FAIL, f"uid {os.geteuid()} without CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN",
               "run with sudo")


def check_load(rows: list[Row]) -> Row | None:
    """Compile and load the real probe program, if the rows before allow it."""
    if any(r.status == FAIL for r in rows):
        return Row("BPF program", WARN, "not tried: fix the failures above first")
    from .tracer import Tracer
    try:
        t = Tracer(load_catalog())
        t.load()
        t.close()
    except Exception as e:
        return Row("BPF program", FAIL, f"probes/calls.bpf.c did not load: {e}",
                   f"{SETUP}; then run `greyhound-trace check` again")
    return Row("BPF program", OK, "probes/calls.bpf.c compiles and loads")


def check_pid(pid: int, catalog: Catalog) -> list[Row]:
    st = read_stat(pid)
    if st is None:
        return [Row(f"pid {pid}", FAIL, "no such process", "give the PID of a rank or launcher")]
    roots, widened = job_roots([pid])
    d = Discovery(roots, catalog)
    d.scan()
    if not d.targets:
        what = ("launcher maps a library; its ranks have not started"
                if d.libraries_seen else
                "maps none of " + ", ".join(catalog.sonames))
        return [Row(f"pid {pid}", WARN if d.libraries_seen else FAIL,
                    f"{st.comm}, {len(d.tree)} process(es): {what}",
                    "" if d.libraries_seen else "attach --wait waits for the libraries")]
    rows = [Row(f"pid {p}", OK, widened_note(p, up)) for p, up in widened]
    for t in sorted(d.targets.values(), key=lambda t: (t.rank is None, t.rank or 0, t.pid)):
        who = t.label("no rank env")
        rows.append(Row(f"pid {t.pid}", OK, f"{who}: " + ", ".join(
            f"{f} ({os.path.basename(m.path)})" for f, m in sorted(t.libraries.items()))))
    return rows


def run_checks(pid: int | None = None, try_load: bool = True) -> list[Row]:
    rows = check_kernel()
    rows += [check_tracefs(), check_headers(), check_bcc(), check_privileges()]
    if try_load:
        r = check_load(rows)
        if r:
            rows.append(r)
    if pid is not None:
        rows += check_pid(pid, load_catalog())
    return rows


def render(rows: list[Row]):
    from rich.table import Table
    from rich.text import Text
    table = Table(title="greyhound-trace check", show_lines=False, expand=False)
    table.add_column("requirement", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail / fix")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    for r in rows:
        detail = Text(r.detail)
        if r.fix:
            detail.append("\nfix: ", style="bold")
            detail.append(r.fix)
        table.add_row(r.name, Text(r.status, style=style[r.status]), detail)
    return table


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == FAIL for r in rows) else 0
