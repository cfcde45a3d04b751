"""The cffi declarations against NVIDIA's cuda.h, and against the simulator.

cffi in ABI mode trusts the declarations blindly, so a wrong struct layout or
a misspelt symbol would only show on a real GPU. These tests compare them with
the header (found through CUDA_HOME, CUDA_PATH or /usr/local/cuda*; skipped
where none is installed), and check that the simulator implements exactly
the declared entry points, no fewer and no more.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from accel.backends.cuda._bindings import CDEF, GRAPH_FUNCTIONS, REQUIRED_FUNCTIONS, VMM_FUNCTIONS, _get_ffi
from tests.fixtures.cuda_driver import build_simulator


def _find_header() -> Path | None:
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    roots += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for root in filter(None, roots):
        header = Path(root) / "include" / "cuda.h"
        if header.is_file():
            return header
    return None


HEADER = _find_header()
needs_header = pytest.mark.skipif(HEADER is None, reason="no CUDA toolkit cuda.h on this machine")

STRUCTS = ("CUuuid", "CUmemLocation", "CUmemAllocationProp", "CUmemAccessDesc", "CUgraphEdgeData")
FIELDS = {
    "CUmemAllocationProp": ("type", "requestedHandleTypes", "location", "win32HandleMetaData", "allocFlags"),
    "CUmemAccessDesc": ("location", "flags"),
    "CUmemLocation": ("type", "id"),
}


def test_layouts_known_from_the_reference() -> None:
    # Measured with gcc on the CUDA 12.9 and 13.5 headers (shared/reference/cuda-driver-facts.md).
    ffi = _get_ffi()
    sizes = {name: ffi.sizeof(name) for name in ("CUmemAllocationProp", "CUmemAccessDesc", "CUmemLocation", "CUuuid")}
    assert sizes == {"CUmemAllocationProp": 32, "CUmemAccessDesc": 12, "CUmemLocation": 8, "CUuuid": 16}
    assert ffi.sizeof("CUgraphEdgeData") == 8


@needs_header
def test_layouts_match_gcc_on_cuda_h(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not on PATH")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "cuda.h"', "int main(void) {"]
    for struct in STRUCTS:
        lines.append(f'printf("{struct} %zu\\n", sizeof({struct}));')
        for name in FIELDS.get(struct, ()):
            lines.append(f'printf("{struct}.{name} %zu\\n", offsetof({struct}, {name}));')
    lines += ["return 0;", "}"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    assert HEADER is not None
    subprocess.run([gcc, f"-I{HEADER.parent}", str(source), "-o", str(exe)], check=True, capture_output=True)
    output = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    measured = dict(line.rsplit(" ", 1) for line in output.splitlines())
    ffi = _get_ffi()
    ours = {}
    for struct in STRUCTS:
        ours[struct] = str(ffi.sizeof(struct))
        for name in FIELDS.get(struct, ()):
            ours[f"{struct}.{name}"] = str(ffi.offsetof(struct, name))
    assert ours == measured


@needs_header
def test_every_bound_symbol_is_named_in_cuda_h() -> None:
    assert HEADER is not None
    text = HEADER.read_text(errors="replace")
    tables = (REQUIRED_FUNCTIONS, VMM_FUNCTIONS, GRAPH_FUNCTIONS)
    symbols = {name for table in tables for names in table.values() for name in names} | {"cuGraphDebugDotPrint"}
    declared = set(re.findall(r"CUresult (cu\w+)\(", CDEF))
    assert symbols <= declared, "every probed symbol needs a declaration"
    missing = sorted(name for name in declared if not re.search(rf"\b{name}\b", text))
    assert missing == []


def test_simulator_exports_exactly_the_declared_functions() -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not on PATH")
    library = build_simulator()
    listing = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listing.stdout.splitlines() if line.split()[-1].startswith("cu")}
    assert exported == set(re.findall(r"CUresult (cu\w+)\(", CDEF))
