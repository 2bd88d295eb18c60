"""Probe catalogs: which library, which symbols, what each argument slot means.

Loaded from probes/*.toml (shipped as ``greyhound_bpf.probes``). Function ids
are assigned in catalog order and index the BPF program slots, so they are
stable for one loaded catalog, not across versions: events carry names.
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .records import GH_F_DEREF_FAILED

# Argument slot names that become event fields. Anything else in a catalog is
# a mistake (a typo would silently drop a field), so loading rejects it.
FIELD_NAMES = frozenset({
    "count", "dtype", "op", "peer", "root", "comm", "stream", "nranks", "comm_rank",
    "parent", "color", "key", "event", "memcpy_kind", "elem_size",
})
IGNORED = "_"
MAX_ARGS = 8      # GH_MAX_ARGS in probes/greyhound.h
MAX_FUNCS = 48    # GH_MAX_FUNCS in probes/greyhound.h
FIELD_SLOT0 = 6   # GH_FIELD_SLOT0
MAX_FIELDS = 2    # GH_MAX_FIELDS
ELEM_SIZES = frozenset({1, 2, 4, 8, 16})

# Enum decoders named by a catalog's `enums` table (values from nccl.h and
# driver_types.h). Unknown values are reported as their number.
ENUMS: dict[str, dict[int, str]] = {
    "nccl_dtype": {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64",
                   5: "uint64", 6: "float16", 7: "float32", 8: "float64",
                   9: "bfloat16", 10: "float8e4m3", 11: "float8e5m2"},
    "nccl_op": {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"},
    "cuda_memcpy_kind": {0: "HostToHost", 1: "HostToDevice", 2: "DeviceToHost",
                         3: "DeviceToDevice", 4: "Default"},
}
# Bytes per element, for the `bytes` of NCCL calls.
NCCL_DTYPE_SIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2,
                   10: 1, 11: 1}
# Slots that hold C ints: the register's upper half is garbage.
INT_FIELDS = frozenset({"dtype", "op", "peer", "root", "nranks", "comm_rank",
                        "color", "key", "memcpy_kind"})


class CatalogError(ValueError):
    pass


@dataclass(frozen=True)
class FunctionSpec:
    fid: int
    family: str
    name: str
    kind: str                 # collective, p2p, group, init, teardown, sync, marker, memcpy
    symbols: tuple[str, ...]  # tried in order
    args: tuple[str, ...]     # slot names, "_" for unreported
    deref: tuple[int, ...]    # slots that are out-parameter pointers
    returns: bool             # False for void functions: ret is not reported
    blocking: bool = False    # the host waits in it for the collective or the device
    # Fields of a struct that slot field_slot points to: (name, byte offset),
    # read at entry into slots FIELD_SLOT0.. (see probes/greyhound.h).
    field_slot: int = 0
    fields: tuple[tuple[str, int], ...] = ()
    # C++ that may throw: timed at the caller's return site, never with a
    # uretprobe (see probes/greyhound.h).
    return_site: bool = False

    @property
    def nargs(self) -> int:
        return len(self.args)

    @property
    def deref_mask(self) -> int:
        return sum(1 << i for i in self.deref)


@dataclass(frozen=True)
class Family:
    name: str
    sonames: tuple[str, ...]
    functions: tuple[FunctionSpec, ...]
    counters: tuple[str, ...]
    enums: dict

    def matches(self, path: str) -> bool:
        base = path.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(base, pat) for pat in self.sonames)


class Catalog:
    def __init__(self, families: list[Family]):
        self.families = {f.name: f for f in families}
        self.functions: list[FunctionSpec] = [fn for f in families for fn in f.functions]
        self.by_name = {fn.name: fn for fn in self.functions}
        # One regex over every soname pattern: a torch rank maps thousands of
        # files, and discovery reads its maps while the job runs.
        self.sonames = [p for f in families for p in f.sonames]
        self._any = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in self.sonames))

    def family_for(self, path: str) -> Family | None:
        base = path.rsplit("/", 1)[-1]
        if not self._any.match(base):
            return None
        for fam in self.families.values():
            if fam.matches(path):
                return fam
        return None

    def decode(self, fn: FunctionSpec, slots, ret: int, flags: int) -> dict:
        """Turn raw argument slots into event fields."""
        fam = self.families[fn.family]
        out: dict = {}
        for i, name in enumerate(fn.args):
            if name == IGNORED:
                continue
            v = int(slots[i])
            if name in INT_FIELDS:
                v = _s32(v)
            if name in fam.enums:
                v = ENUMS[fam.enums[name]].get(v, v)
            out[name] = v
        for j, (name, _) in enumerate(fn.fields):
            out[name] = int(slots[FIELD_SLOT0 + j])
        if "elem_size" in out:
            # A struct layout from another gloo version reads garbage: keep
            # the numbers only when the element size is a real one.
            if out["elem_size"] in ELEM_SIZES and 0 <= out.get("count", 0) < 1 << 40:
                out["bytes"] = out.get("count", 0) * out["elem_size"]
            else:
                out.pop("elem_size")
                out.pop("count", None)
        if fn.family == "nccl" and "count" in out and "dtype" in fn.args:
            size = NCCL_DTYPE_SIZE.get(int(slots[fn.args.index("dtype")]) & 0xFFFFFFFF)
            if size:
                out["bytes"] = out["count"] * size
        out["ret"] = _s32(ret) if fn.returns else None
        if flags & GH_F_DEREF_FAILED:
            out["deref_failed"] = True
        return out


    def slot_mask(self) -> np.ndarray:
        """[function id, slot]: True where the slot holds something decode()
        reads (a named argument or a struct field); the rest of a record's
        slots are left-over register values."""
        mask = np.zeros((max(len(self.functions), 1), MAX_ARGS), dtype=bool)
        for fn in self.functions:
            for i, name in enumerate(fn.args):
                mask[fn.fid, i] = name != IGNORED
            for j in range(len(fn.fields)):
                mask[fn.fid, FIELD_SLOT0 + j] = True
        return mask

    def encode(self, fn: FunctionSpec, fields: dict) -> tuple[list[int], int, int]:
        """The raw (slots, ret, flags) that decode() turns into `fields`: a
        `call` event of an older recording back into a record."""
        fam = self.families[fn.family]
        slots = [0] * MAX_ARGS
        for i, name in enumerate(fn.args):
            v = fields.get(name)
            if name == IGNORED or v is None:
                continue
            if isinstance(v, str) and name in fam.enums:
                v = next((k for k, n in ENUMS[fam.enums[name]].items() if n == v), 0)
            slots[i] = int(v) & 0xFFFFFFFFFFFFFFFF
        for j, (name, _) in enumerate(fn.fields):
            if fields.get(name) is not None:
                slots[FIELD_SLOT0 + j] = int(fields[name]) & 0xFFFFFFFFFFFFFFFF
        ret = fields.get("ret")
        return slots, int(ret or 0), GH_F_DEREF_FAILED if fields.get("deref_failed") else 0


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def probes_dir() -> Path:
    return Path(str(resources.files("greyhound_bpf.probes")))


def load_catalog(directory: Path | None = None) -> Catalog:
    directory = directory or probes_dir()
    families = []
    fid = 0
    for path in sorted(directory.glob("*.toml")):
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
        fams, fid = _parse_family(raw, path.name, fid)
        families.append(fams)
    if fid > MAX_FUNCS:
        raise CatalogError(f"{fid} functions exceed the {MAX_FUNCS} BPF slots")
    return Catalog(families)


def _parse_family(raw: dict, where: str, fid: int) -> tuple[Family, int]:
    try:
        name = raw["family"]
        sonames = raw["soname"]
    except KeyError as e:
        raise CatalogError(f"{where}: missing {e}") from None
    if isinstance(sonames, str):
        sonames = [sonames]
    enums = raw.get("enums", {})
    throws = raw.get("throws", False)
    if not isinstance(throws, bool):
        raise CatalogError(f"{where}: `throws` must be true or false")
    for field, enum in enums.items():
        if enum not in ENUMS:
            raise CatalogError(f"{where}: unknown enum {enum!r} for {field}")
    fns = []
    for entry in raw.get("function", []):
        args, deref = [], []
        for i, slot in enumerate(entry.get("args", [])):
            if slot.endswith("*"):
                slot = slot[:-1]
                deref.append(i)
            if slot != IGNORED and slot not in FIELD_NAMES:
                raise CatalogError(f"{where}: {entry['name']}: unknown field {slot!r}")
            args.append(slot)
        if len(args) > MAX_ARGS:
            raise CatalogError(f"{where}: {entry['name']}: more than {MAX_ARGS} slots")
        sf = entry.get("struct_fields", {})
        fields = tuple((f["name"], int(f["offset"])) for f in sf.get("fields", []))
        if fields:
            if len(fields) > MAX_FIELDS or len(args) > FIELD_SLOT0:
                raise CatalogError(f"{where}: {entry['name']}: at most {MAX_FIELDS} struct "
                                   f"fields, with at most {FIELD_SLOT0} argument slots")
            for fname, off in fields:
                if fname not in FIELD_NAMES or not 0 <= off < 1 << 16:
                    raise CatalogError(f"{where}: {entry['name']}: bad struct field {fname!r}")
        fns.append(FunctionSpec(
            fid=fid, family=name, name=entry["name"], kind=entry["kind"],
            symbols=tuple(entry.get("symbols", [entry["name"]])),
            args=tuple(args), deref=tuple(deref),
            returns=bool(entry.get("returns", True)),
            blocking=bool(entry.get("blocking", False)),
            field_slot=int(sf.get("slot", 0)), fields=fields, return_site=throws,
        ))
        fid += 1
    counters = tuple(c["name"] for c in raw.get("counter", []))
    return Family(name, tuple(sonames), tuple(fns), counters, dict(enums)), fid
