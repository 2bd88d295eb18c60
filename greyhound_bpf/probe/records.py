"""User-space mirror of probes/greyhound.h.

tests/test_abi.py compiles the header and checks every size and offset here
against it. Records are decoded in bulk with the NumPy dtype, not one ctypes
object at a time.
"""
import ctypes as ct

import numpy as np

GH_MAX_ARGS = 8
GH_F_DEREF_FAILED = 0x1
GH_F_NEW_SITE = 0x2
GH_SITE_NEW = 0
GH_SITE_PROBED = 1
GH_SITE_UNPROBEABLE = 2


class GhCall(ct.Structure):
    _fields_ = [
        ("start_ns", ct.c_uint64),
        ("dur_ns", ct.c_uint64),
        ("pid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("fn", ct.c_uint16),
        ("flags", ct.c_uint16),
        ("ret", ct.c_int32),
        ("args", ct.c_uint64 * GH_MAX_ARGS),
    ]


GH_FIELD_SLOT0 = 6
GH_MAX_FIELDS = 2


class GhFnSpec(ct.Structure):
    _fields_ = [
        ("nargs", ct.c_uint8),
        ("deref_mask", ct.c_uint8),
        ("field_slot", ct.c_uint8),
        ("nfields", ct.c_uint8),
        ("field_off", ct.c_uint16 * GH_MAX_FIELDS),
        ("flags", ct.c_uint16),
    ]


GH_SPEC_RETURN_SITE = 0x1


class GhSiteKey(ct.Structure):
    _fields_ = [("pid", ct.c_uint32), ("fn", ct.c_uint32), ("addr", ct.c_uint64)]


class GhProbeKey(ct.Structure):
    _fields_ = [("pid", ct.c_uint32), ("pad", ct.c_uint32), ("addr", ct.c_uint64)]


# Same layout as GhCall, for np.frombuffer over a batch of ring-buffer records.
CALL_DTYPE = np.dtype({
    "names": [f[0] for f in GhCall._fields_],
    "formats": ["<u8", "<u8", "<u4", "<u4", "<u2", "<u2", "<i4", ("<u8", GH_MAX_ARGS)],
    "offsets": [getattr(GhCall, f[0]).offset for f in GhCall._fields_],
    "itemsize": ct.sizeof(GhCall),
})
