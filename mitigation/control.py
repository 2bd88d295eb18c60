"""The control file: how greyhound-trace tells a training script what to do.

One JSON document (shared/DESIGN.md, "Control file"), written atomically by
the tool (``ControlWriter``) and read by the trainer (``ControlFile``):

    ctl = ControlFile(path, rank=rank, dp_rank=dp_rank)
    ctl.announce(microbatches=n_micro, world=world)   # what the tool may rebalance
    for step in ...:
        plan = ctl.poll()        # None, or a new validated Plan (one stat() when unchanged)
        if plan:
            n_micro = plan.microbatches_for(dp_rank, default=n_micro)
            ctl.ack(plan, microbatches=n_micro)
        scale = loss_scale(world, total_microbatches)   # loss *= scale per micro-batch

A malformed file, an unknown version or a half-written file is rejected with
one warning and the last good plan stays in force. So is a hostile one: a
symbolic link, a FIFO or device, a file over MAX_DOC_BYTES or JSON nested
too deeply is refused in bounded time and memory (``read_doc``); every file
of this protocol, plans, acks and restart requests, is read that way.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
# A trainer that saved a checkpoint for a checkpoint_restart plan exits with
# this code (EX_TEMPFAIL), after rank 0 wrote the restart request
# `<control>.restart`; greyhound-run relaunches the job when it sees one.
RESTART_EXIT_CODE = 75
# The largest document read: a plan for 8,192 data-parallel ranks is ~120 KiB.
MAX_DOC_BYTES = 1 << 20
STRATEGIES = ("none", "rebalance_microbatches", "reconfigure_pipeline", "checkpoint_restart")
log = logging.getLogger("greyhound.control")


class PlanError(ValueError):
    """The control file's content is not a valid plan."""


@dataclass(frozen=True)
class Plan:
    seq: int
    strategy: str
    issued_ns: int = 0
    microbatches: dict[int, int] | None = None   # dp_rank -> count, summing to the global count
    layer_split: list[int] | None = None         # layers per pipeline stage
    restart: dict | None = None                  # {"checkpoint": true, "exclude": [ranks],
    #                                              "where": [{rank, host, cpus, gpu}]}
    reason: str = ""
    v: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        d = {"v": self.v, "seq": self.seq, "issued_ns": self.issued_ns,
             "strategy": self.strategy, "reason": self.reason}
        if self.microbatches is not None:
            d["microbatches"] = {str(k): v for k, v in sorted(self.microbatches.items())}
        if self.layer_split is not None:
            d["layer_split"] = list(self.layer_split)
        if self.restart is not None:
            d["restart"] = dict(self.restart)
        return d

    @classmethod
    def from_dict(cls, d) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("not a JSON object")
        if d.get("v") != SCHEMA_VERSION:
            raise PlanError(f"unknown version {d.get('v')!r} (this client reads {SCHEMA_VERSION})")
        seq = d.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            raise PlanError("seq must be a positive integer")
        strategy = d.get("strategy")
        if strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {strategy!r}")
        mb = d.get("microbatches")
        if mb is not None:
            if not isinstance(mb, dict) or not mb:
                raise PlanError("microbatches must be a non-empty object")
            try:
                mb = {int(k): v for k, v in mb.items()}
            except ValueError:
                raise PlanError("microbatches keys must be data-parallel ranks") from None
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in mb.values()):
                raise PlanError("every rank needs a whole number of micro-batches >= 1")
            if sorted(mb) != list(range(len(mb))):
                raise PlanError("microbatches must name data-parallel ranks 0..N-1")
        if strategy == "rebalance_microbatches" and mb is None:
            raise PlanError("rebalance_microbatches needs microbatches")
        split = d.get("layer_split")
        if split is not None and (not isinstance(split, list) or not split or any(
                not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in split)):
            raise PlanError("layer_split must list >= 1 layers per stage")
        restart = d.get("restart")
        if restart is not None and not isinstance(restart, dict):
            raise PlanError("restart must be an object")
        issued = d.get("issued_ns", 0)
        if not isinstance(issued, int):
            raise PlanError("issued_ns must be an integer")
        return cls(seq, strategy, issued, mb, split, restart, str(d.get("reason", "")))

    def microbatches_for(self, dp_rank: int, default: int) -> int:
        if self.microbatches is None:
            return default
        return self.microbatches.get(dp_rank, default)

    @property
    def total_microbatches(self) -> int | None:
        return sum(self.microbatches.values()) if self.microbatches else None


def even_split(total: int, ranks: int) -> list[int]:
    """`total` micro-batches over `ranks` ranks, the first ones one more."""
    base, extra = divmod(total, ranks)
    return [base + (1 if i < extra else 0) for i in range(ranks)]


def loss_scale(world: int, total_microbatches: int) -> float:
    """Per-micro-batch loss scale that keeps the all-reduced gradient equal to
    the gradient of the whole global batch, however the micro-batches are
    split. DDP averages over `world` ranks; the global gradient is the mean
    over all `total_microbatches` (of equal size), so each micro-batch's loss
    is scaled by world / total instead of 1 / (this rank's count)."""
    if world < 1 or total_microbatches < world:
        raise ValueError("need world >= 1 and at least one micro-batch per rank")
    return world / total_microbatches


def _refuse_symlink(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise PlanError(f"{path} is a symbolic link; refusing to follow it")


def read_doc(path: str | os.PathLike, limit: int = MAX_DOC_BYTES):
    """One JSON document from a regular file, read in bounded time and
    memory: no symbolic link is followed, a FIFO or device is not read (and
    never blocks the open), at most `limit` bytes are read and nesting too
    deep for the parser is refused. Raises PlanError (a ValueError) for a
    file it refuses, OSError for one it cannot open (FileNotFoundError...)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PlanError(f"{path} is a symbolic link; refusing to follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PlanError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise PlanError(f"{path} holds {st.st_size} bytes, more than a plan takes ({limit})")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise PlanError(f"{path} grew past {limit} bytes while read")
    finally:
        os.close(fd)
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise PlanError(f"{path} is nested too deeply to be a plan") from None


def atomic_write_json(path: Path, doc: dict, mode: int = 0o644) -> None:
    """Write `doc` to `path` atomically: a temporary file in the same
    directory, fsync, rename over the target, fsync the directory. A reader
    sees the old document or the new one, never a mix."""
    path = Path(path)
    _refuse_symlink(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))
            fh.write("\n")
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class ControlWriter:
    """The tool's side: issues plans with increasing seq, reads acks."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise PlanError(f"no directory {self.path.parent} for the control file")
        _refuse_symlink(self.path)
        self.seq = 0
        try:   # continue numbering after a restart of the tool
            self.seq = int(read_doc(self.path).get("seq", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def issue(self, strategy: str, *, microbatches: dict[int, int] | None = None,
              layer_split: list[int] | None = None, restart: dict | None = None,
              reason: str = "", seq: int | None = None) -> Plan:
        """Write a plan: number `seq` (the analysis numbers its plans), or
        the next one."""
        seq = self.seq + 1 if seq is None else seq
        if seq <= self.seq:
            raise PlanError(f"plan {seq} is not newer than plan {self.seq} in {self.path}")
        plan = Plan(seq, strategy, time.time_ns(), microbatches, layer_split,
                    restart, reason)
        Plan.from_dict(plan.to_dict())          # never write what a trainer would reject
        atomic_write_json(self.path, plan.to_dict())
        self.seq = plan.seq
        return plan

    def ack_docs(self) -> dict[int, dict]:
        """rank -> its last acknowledgement, with what it runs now
        (``microbatches``, ``dp_rank``, ``world``, ``stage``...)."""
        out = {}
        for p in self.path.parent.glob(f"{self.path.name}.ack.*"):
            try:
                d = read_doc(p)
                d["rank"], d["seq"] = int(d["rank"]), int(d["seq"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            out[d["rank"]] = d
        return out

    def restart_observed_s(self) -> float | None:
        """The last restart's cost as measured by greyhound-run, if any."""
        try:
            return float(read_doc(f"{self.path}.restart_cost")["restart_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass
class ControlFile:
    """The trainer's side. ``poll()`` costs one stat() when nothing changed."""
    path: str | os.PathLike
    rank: int = 0
    dp_rank: int | None = None
    plan: Plan | None = None                     # the last good plan, in force
    rejected: int = 0                            # documents rejected so far
    _sig: tuple | None = field(default=None, repr=False)
    _state: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.path = Path(self.path)

    def poll(self) -> Plan | None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig == self._sig:
            return None
        self._sig = sig
        try:
            plan = Plan.from_dict(read_doc(self.path))
        except (OSError, ValueError) as e:
            # json.JSONDecodeError and PlanError are ValueErrors; a file being
            # written by a non-atomic writer lands here too.
            self.rejected += 1
            log.warning("greyhound control file %s rejected (%s); keeping plan seq %s",
                        self.path, e, self.plan.seq if self.plan else None)
            return None
        if self.plan is not None and plan.seq <= self.plan.seq:
            return None
        self.plan = plan
        return plan

    def announce(self, **state) -> None:
        """Tell the tool what this rank runs before any plan (an ack of seq
        0): ``microbatches`` (this rank's count), ``world``, and for a
        pipeline ``stage``, ``layer_split`` and ``pp_microbatches`` (the
        schedule's micro-batches per step); ``checkpoint=True`` when the
        trainer can save and resume (S3/S4). The tool only proposes what a
        trainer announced it can do."""
        self._write_ack(0, state)

    def ack(self, plan: Plan, **state) -> None:
        """Acknowledge `plan` once applied; `state` as in announce()."""
        self._write_ack(plan.seq, state)

    def request_restart(self, plan: Plan, checkpoint: str) -> None:
        """Rank 0, after the checkpoint is saved: ask the supervisor to
        relaunch (then every rank exits with RESTART_EXIT_CODE)."""
        restart = plan.restart or {}
        atomic_write_json(Path(f"{self.path}.restart"),
                          {"v": SCHEMA_VERSION, "seq": plan.seq, "checkpoint": str(checkpoint),
                           "exclude": list(restart.get("exclude", [])),
                           "where": list(restart.get("where", [])),
                           "layer_split": plan.layer_split, "saved_ns": time.time_ns()})

    def _write_ack(self, seq: int, state: dict) -> None:
        self._state.update(state)        # announced facts carry into later acks
        doc = {"v": SCHEMA_VERSION, **self._state, "seq": seq, "rank": self.rank,
               "dp_rank": self.rank if self.dp_rank is None else self.dp_rank,
               "applied_ns": time.time_ns()}
        atomic_write_json(Path(f"{self.path}.ack.{self.rank}"), doc)


def writer_lock(control_file: str | os.PathLike):
    """An exclusive lock on `<control>.lock` for as long as this process
    lives (the kernel drops it on any exit, kill -9 included): (the open
    file, None), or (None, the holder's pid if it wrote one)."""
    path = f"{control_file}.lock"
    try:
        fh = open(path, "a+")
    except OSError:
        # No lock where the plans go: writing them will fail too, and say so.
        return open(os.devnull), None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        return None, int(holder) if holder.isdigit() else None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh, None
