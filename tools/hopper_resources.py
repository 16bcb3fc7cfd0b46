"""Compile a Triton kernel ahead of time for Hopper (sm_90a) without a GPU and read its resources.

Shared by the offline reports of the kernels (tools/attention_resources.py, bench/gdn_resources.py):
registers, stack (local memory: spills and arrays), shared memory, and SASS counts read with the
``cuobjdump`` shipped in Triton's wheel. Picks launch configurations before timing them on a GPU.

The report is that of the Triton that is imported, and register allocation differs between releases (the
256-dim dk/dv kernel: 680 B of stack under Triton 3.6, 216 B under 3.9). To match the GPU machine's 3.6, install
that wheel beside the CPU build of torch and put it first on the path:
``pip install --no-deps --target /tmp/t36 triton==3.6.0`` then ``PYTHONPATH=/tmp/t36 python tools/...``.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200


def nvidia_tool(name: str) -> str:
    """Path of a CUDA binary shipped in Triton's wheel (cuobjdump, ptxas)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def hopper_resources(fn, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int,
                     aligned_pointers: bool = False, source_cls=ASTSource, options: dict | None = None,
                     sass_out: str | None = None) -> dict:
    """Compile `fn` (a @triton.jit function) for sm_90 with `signature` (argument -> type string,
    constexprs included as "constexpr") and report {regs, stack, shared, fits, wgmma, wgmma_waits,
    wgmma_serialized, tma_loads, spill_loads, spill_stores, sass_digest}; wgmma_waits counts WARPGROUP.DEPBAR. In a
    Gluon kernel, whose source places its own waits, one wait per wgmma means ptxas serialised them and
    wgmma_serialized gives its reason (None otherwise, and always for a Triton kernel, whose tl.dot waits for
    itself); sass_digest (sha1 of the SASS instructions) tells whether a source refactor
    changed the machine code. `aligned_pointers`: give every pointer the 16-byte divisibility the JIT sees for
    torch allocations (without it Triton does not pipeline some loads). `source_cls`: GluonASTSource for a
    @gluon.jit kernel; `options`: further compile options (maxnreg); `sass_out`: write the SASS there. Also
    reports `setmaxnreg`: the register counts of the USETMAXREG instructions (warp-specialised kernels: the
    per-partition budgets; `regs` is then the launch count, maxnreg)."""
    attrs = None
    if aligned_pointers:
        attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
    kernel = triton.compile(source_cls(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, **(options or {})))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as handle:
            handle.write(kernel.asm["cubin"])
        usage = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    if sass_out:
        with open(sass_out, "w") as handle:
            handle.write(sass)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    shared = kernel.metadata.shared
    waits, wgmma = sass.count("WARPGROUP.DEPBAR"), sass.count("HGMMA")
    return dict(regs=int(regs.group(1)), stack=int(regs.group(2)), shared=shared,
                fits=shared <= HOPPER_SHARED_LIMIT, wgmma=wgmma, wgmma_waits=waits,
                wgmma_serialized=(serialisation_reason(kernel, options)
                                  if source_cls is not ASTSource and wgmma and waits >= wgmma else None),
                tma_loads=sass.count("UTMALDG"),
                setmaxnreg=sorted({int(n, 16) for n in re.findall(r"USETMAXREG\S* (?:UP\d, )?(0x[0-9a-f]+)", sass)}),
                spill_loads=sass.count("LDL"), spill_stores=sass.count("STL"),
                sass_digest=hashlib.sha1("\n".join(line for line in sass.splitlines() if "/*" in line)
                                         .encode()).hexdigest()[:12])


def serialisation_reason(kernel, options: dict | None) -> str:
    """Why ptxas serialised a kernel's wgmma: its "Potential Performance Loss" line (C7512 registers, C7514 / C7515
    what stands between a wgmma and its wait), read by assembling the kernel's PTX again with the bundled ptxas
    (Triton does not keep ptxas's messages)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as handle:
            handle.write(kernel.asm["ptx"])
        limit = [f"--maxrregcount={options['maxnreg']}"] if options and options.get("maxnreg") else []
        run = subprocess.run([nvidia_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin"),
                              *limit], capture_output=True, text=True)
    found = re.findall(r"\((C\d+)\) Potential Performance Loss: (.*?)(?: in the function '[^']*')?$",
                       run.stdout + run.stderr, flags=re.MULTILINE)
    return "; ".join(f"{code}: {' '.join(text.split())}" for code, text in found) or "no reason given by ptxas"
