"""The ctypes/NumPy mirror of probes/greyhound.h matches the C layout.

The header is compiled with the system C compiler and asked for every size
and offset, the way tetragon's alignchecker checks its Go mirrors.
"""
import ctypes as ct
import shutil
import subprocess

import pytest

from greyhound_bpf.probe import catalog as catalog_mod
from greyhound_bpf.probe.records import (CALL_DTYPE, GH_F_NEW_SITE, GH_MAX_ARGS, GH_SITE_PROBED,
                                         GH_SITE_UNPROBEABLE, GH_SPEC_RETURN_SITE, GhCall,
                                         GhFnSpec, GhProbeKey, GhSiteKey)
from greyhound_bpf.probe.catalog import probes_dir

PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include <linux/types.h>
#include "greyhound.h"
#define F(s, f) printf(#s "." #f " %zu %zu\n", offsetof(struct s, f), sizeof(((struct s *)0)->f));
int main(void) {
    printf("gh_call %zu\n", sizeof(struct gh_call));
    printf("gh_fn_spec %zu\n", sizeof(struct gh_fn_spec));
    printf("GH_MAX_ARGS %d\nGH_MAX_FUNCS %d\n", GH_MAX_ARGS, GH_MAX_FUNCS);
    F(gh_call, start_ns) F(gh_call, dur_ns) F(gh_call, pid) F(gh_call, tid)
    F(gh_call, fn) F(gh_call, flags) F(gh_call, ret) F(gh_call, args)
    F(gh_fn_spec, nargs) F(gh_fn_spec, deref_mask) F(gh_fn_spec, field_slot)
    F(gh_fn_spec, nfields) F(gh_fn_spec, field_off) F(gh_fn_spec, flags)
    printf("gh_site_key %zu\n", sizeof(struct gh_site_key));
    F(gh_site_key, pid) F(gh_site_key, fn) F(gh_site_key, addr)
    printf("gh_probe_key %zu\n", sizeof(struct gh_probe_key));
    F(gh_probe_key, pid) F(gh_probe_key, addr)
    printf("GH_SPEC_RETURN_SITE %d\n", GH_SPEC_RETURN_SITE);
    printf("GH_F_NEW_SITE %d\nGH_SITE_PROBED %d\nGH_SITE_UNPROBEABLE %d\n",
           GH_F_NEW_SITE, GH_SITE_PROBED, GH_SITE_UNPROBEABLE);
    printf("GH_FIELD_SLOT0 %d\nGH_MAX_FIELDS %d\n", GH_FIELD_SLOT0, GH_MAX_FIELDS);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to check the ABI"
    d = tmp_path_factory.mktemp("abi")
    (d / "abi.c").write_text(PROGRAM)
    subprocess.run([cc, f"-I{probes_dir()}", "-o", str(d / "abi"), str(d / "abi.c")], check=True)
    out = subprocess.run([str(d / "abi")], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in out.splitlines():
        name, *vals = line.split()
        layout[name] = tuple(int(v) for v in vals)
    return layout


def test_struct_sizes_match(c_layout):
    assert c_layout["gh_call"] == (ct.sizeof(GhCall),)
    assert c_layout["gh_call"] == (CALL_DTYPE.itemsize,)
    assert c_layout["gh_fn_spec"] == (ct.sizeof(GhFnSpec),)
    assert c_layout["gh_site_key"] == (ct.sizeof(GhSiteKey),)
    assert c_layout["gh_probe_key"] == (ct.sizeof(GhProbeKey),)


@pytest.mark.parametrize("field", [f[0] for f in GhCall._fields_])
def test_gh_call_offsets_match(c_layout, field):
    off, size = c_layout[f"gh_call.{field}"]
    assert getattr(GhCall, field).offset == off
    assert getattr(GhCall, field).size == size
    assert CALL_DTYPE.fields[field][1] == off
    assert CALL_DTYPE.fields[field][0].itemsize == size


@pytest.mark.parametrize("struct, field", [
    *((GhFnSpec, f) for f in ["nargs", "deref_mask", "field_slot", "nfields", "field_off", "flags"]),
    *((GhSiteKey, f) for f in ["pid", "fn", "addr"]),
    *((GhProbeKey, f) for f in ["pid", "addr"])])
def test_spec_and_key_offsets_match(c_layout, struct, field):
    name = {GhFnSpec: "gh_fn_spec", GhSiteKey: "gh_site_key",
            GhProbeKey: "gh_probe_key"}[struct]
    off, size = c_layout[f"{name}.{field}"]
    assert (getattr(struct, field).offset, getattr(struct, field).size) == (off, size)


def test_limits_match(c_layout):
    assert c_layout["GH_MAX_ARGS"] == (GH_MAX_ARGS,) == (catalog_mod.MAX_ARGS,)
    assert c_layout["GH_MAX_FUNCS"] == (catalog_mod.MAX_FUNCS,)
    assert c_layout["GH_FIELD_SLOT0"] == (catalog_mod.FIELD_SLOT0,)
    assert c_layout["GH_MAX_FIELDS"] == (catalog_mod.MAX_FIELDS,)
    assert c_layout["GH_SPEC_RETURN_SITE"] == (GH_SPEC_RETURN_SITE,)
    assert c_layout["GH_F_NEW_SITE"] == (GH_F_NEW_SITE,)
    assert c_layout["GH_SITE_PROBED"] == (GH_SITE_PROBED,)
    assert c_layout["GH_SITE_UNPROBEABLE"] == (GH_SITE_UNPROBEABLE,)
