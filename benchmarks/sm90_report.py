"""Static sm_90 report of every Triton kernel the runners and GPU checks launch, compiled on CPU (no GPU, no run).

Each case calls the project's own launch code (the functions the runners, the TensorRT plugins and
benchmarks/gpu_*.py call) with CPU tensors at the shapes the checks use (K3's and the smoke run's tiny ones),
under a stand-in active Triton driver whose target is `GPUTarget("cuda", 90, 32)`: Triton's JIT specializes the
arguments as it would on an H100 / H200 and its `jit_cache_hook` records the compile request and stops the
launch (nothing runs, the tensors may be empty). AOT kernels (the `aot_compile` of the TensorRT plugins) are
recorded at their `triton.compile` call. Every distinct request is then compiled with `triton.compile` for sm_90
(the ptxas Triton ships), its PTX assembled again with `ptxas -v` (Triton's own flags) for registers and spills,
and its SASS read back with Triton's `cuobjdump`. Per kernel and config (one row; `launches` lists the cases and
grids that ask for it, with `programs`, the grid's size):
  kernel, group, num_warps, num_stages, shared (bytes of shared memory per block), n_regs, spill_stores,
  spill_loads (bytes per thread), wgmma (HGMMA), mma_sync (HMMA), cp_async (LDGSTS), cp_async_bulk (UBLKCP /
  UTMALDG / UTMAPF), global_scratch / profile_scratch (bytes per program), aot (an `aot_compile` result), and for
  the kernels with a unit of work (MoE: a weight; attention and indexer: a key row) the inner loop (the innermost
  loop holding a matrix instruction, else a global load; the whole program when it has no loop: `loop_scope`):
  its SASS instructions per warp (`loop_instructions`), local loads in it (`loop_local_loads`), and `instructions_per_unit` = loop instructions x threads / units per iteration.
Compiled results (metadata, ptxas log, SASS) are cached by the request (Triton's hash of the kernel source with its
callees, constants and specialization; the options; the Triton version), so an unchanged kernel is not compiled again (`--cache DIR`, default
~/.cache/moe_export/sm90_report). These are static facts (what ptxas made), not measurements.

  python benchmarks/sm90_report.py [--json] [--kernels moe,indexer] [--cache DIR] [--jobs N]

Groups: moe, indexer, mla, sampler, transport, gds, conv, cache_write.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels' UPCAST constexprs would take the interpreter's form
    sys.exit("sm90_report: run without TRITON_INTERPRET=1 (it compiles for sm_90, it does not interpret)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM90_SHARED_PER_BLOCK = 232_448  # bytes of shared memory one block may use on sm_90 (227 KiB)
_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_cooperative_grid")
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CACHE_FORMAT = 1  # what a cache file holds (`compile_request`); raise it when that changes
GROUPS = ("moe", "indexer", "mla", "sampler", "transport", "gds", "conv", "cache_write")


@dataclasses.dataclass
class Request:
    """One compile request: the kernel's ASTSource and options, the cases (and grids) that made it."""

    group: str
    src: object
    options: dict
    aot: bool
    launches: list

    @property
    def kernel(self) -> str:
        return self.src.fn.__name__

    def constants(self) -> dict:
        """Constexpr values by argument name."""
        names = self.src.fn.arg_names
        return {names[k[0]]: v for k, v in self.src.constants.items() if len(k) == 1}

    def key(self) -> str:
        """Cache key: Triton's source hash (kernel, callees, constants, specialization), the options, Triton's
        version and the cache format."""
        text = json.dumps([self.src.hash(), sorted(self.options.items()), triton.__version__, CACHE_FORMAT])
        return hashlib.sha256(text.encode()).hexdigest()


class StandInDriver:
    """The active driver while the launch code runs: device 0, stream 0, target sm_90; nothing is loaded."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")


class Recorder:
    """Inside `with recorder.group(name, case)`: the JIT launches and AOT compiles of the project's code are
    recorded (per distinct request) instead of run."""

    def __init__(self) -> None:
        self.requests: dict[tuple, Request] = {}
        self._group = self._case = None
        self._grid = None

    def _add(self, src, options: dict, aot: bool) -> None:
        options = {k: options[k] for k in _OPTION_KEYS if options.get(k) is not None}
        ident = (self._group, src.hash(), json.dumps(sorted(options.items())))
        req = self.requests.setdefault(ident, Request(self._group, src, options, aot, []))
        programs = None if self._grid is None else int(torch.tensor(self._grid).prod())
        launch = {"case": self._case, "grid": self._grid, "programs": programs}
        if launch not in req.launches:
            req.launches.append(launch)

    def _jit_hook(self, *, fn, compile, **_):
        spec = json.loads(compile["specialization_data"])["options"]
        src = triton.compiler.ASTSource(fn.jit_function, compile["signature"], compile["constants"],
                                        compile["configs"][0])  # fmt: skip
        self._add(src, spec, aot=False)
        return True  # handled: Triton compiles and launches nothing

    def _aot_compile(self, src, target=None, options=None, **_):
        assert target == TARGET, f"an AOT compile for {target}, the report asks for sm_90"
        self._add(src, dict(options or {}), aot=True)

    @contextlib.contextmanager
    def group(self, name: str, case: str):
        saved = (knobs.runtime.jit_cache_hook, triton.compile, JITFunction.__getitem__, driver._active)
        recorder = self

        def getitem(fn, grid):
            def launch(*args, **kwargs):
                recorder._grid = list(grid) if isinstance(grid, tuple) else None
                return fn.run(*args, grid=grid, warmup=False, **kwargs)

            return launch

        self._group, self._case = name, case
        driver.set_active(StandInDriver())
        knobs.runtime.jit_cache_hook = self._jit_hook
        triton.compile = self._aot_compile
        JITFunction.__getitem__ = getitem
        try:
            yield
        finally:
            knobs.runtime.jit_cache_hook, triton.compile, JITFunction.__getitem__, driver._active = saved
            self._grid = None


# ----------------------------------------------------------------------------------------------------------- cases
# Each case runs launch code with CPU tensors (torch.empty: never read) at one shape of a check or a runner.

MOE_K3 = dict(E=14, D=3584, I=3072)  # one EP rank of K3 (896 experts / 64), latent D, moe_intermediate_size
MOE_TINY = dict(E=6, D=64, I=64)  # gpu_check's smoke shapes


def _moe_weights(E, D, I):
    """Empty MXFP4 experts as the op takes them: w13 [E, 2I, D/2] + scales [E, 2I, D/32], w2 [E, D, I/2] + [E, D, I/32]."""
    return (torch.empty(E, 2 * I, D // 2, dtype=torch.uint8), torch.empty(E, 2 * I, D // 32, dtype=torch.uint8),
            torch.empty(E, D, I // 2, dtype=torch.uint8), torch.empty(E, D, I // 32, dtype=torch.uint8))


def case_moe(rec: Recorder) -> None:
    from moe_export.plugins.moe_mxfp4 import triton_kernel as moe

    for shapes, name in ((MOE_K3, "k3"), (MOE_TINY, "tiny")):
        E, D, I = shapes["E"], shapes["D"], shapes["I"]
        w = _moe_weights(E, D, I)
        steps = [(1, 1), (16, 4), (64, 4), (4096, 4)] if name == "k3" else [(1, 1), (4, 4), (8, 4)]
        for T, k in steps:
            x = torch.empty(T, D, dtype=torch.bfloat16)
            ids = torch.arange(T * k).remainder(E).view(T, k)
            with rec.group("moe", f"{name} T={T} k={k}"):
                moe.moe_mxfp4_triton(x, ids, torch.empty(T, k), *w, expert_offset=0, activation="silu")
        # the dp layer: the all-to-all's receive buffer with device counts (K3: 192 decode rows x top-16)
        rows = 192 if name == "k3" else 8
        x = torch.empty(rows, D, dtype=torch.bfloat16)
        ids = torch.arange(rows * 16).remainder(E).view(rows, 16)
        with rec.group("moe", f"{name} counted rows={rows} k=16"):
            moe.moe_mxfp4_triton(x, ids, torch.empty(rows, 16), *w, expert_offset=0,
                                 recv_counts=torch.tensor([rows // 2, rows // 2]), row_bound=rows)  # fmt: skip


def _paged(seqs: int, L: int, bs: int, width: int, dtype):
    """A pool table (no pool behind it: nothing runs), shuffled tables, the step's token at L - 1."""
    table = torch.zeros(1, 3, dtype=torch.int64)
    tables = torch.zeros(seqs, L // bs, dtype=torch.int64)
    return table, tables, torch.arange(seqs + 1), torch.full((seqs,), L - 1)


def case_indexer(rec: Recorder) -> None:
    from moe_export.plugins.dsa_indexer.triton_kernel import dsa_indexer_launch

    for name, (L, Hi, Di, topk, bs) in (("k3 128k", (131072, 64, 128, 2048, 64)), ("tiny", (256, 4, 16, 16, 16))):
        table, tables, cu, pos = _paged(1, L, bs, Di, torch.bfloat16)
        with rec.group("indexer", name):
            dsa_indexer_launch(torch.empty(1, Hi, Di), torch.empty(1, Hi), table, 0, bs, torch.bfloat16,
                               torch.empty(1, Di), cu, tables, pos, topk=topk)  # fmt: skip


def case_mla(rec: Recorder) -> None:
    from moe_export.plugins.sparse_mla_attention import triton_kernel as mla

    shapes = (("k3 128k", 131072, 12, 2048, 64, (1, 64)), ("tiny", 256, 2, 16, 16, (1, 2)))
    for name, L, H, topk, bs, seqs in shapes:
        for n in seqs:
            for dtype in (torch.bfloat16, torch.uint8):
                table, tables, cu, pos = _paged(n, L, bs, 576, dtype)
                idx = torch.zeros(n, topk, dtype=torch.int64)
                with rec.group("mla", f"{name} seqs={n} pool={str(dtype)[6:]}"):
                    mla.sparse_mla_attention_launch(torch.empty(n, H, 576), table, 0, bs, dtype, torch.empty(n, 576),
                                                    cu, tables, pos, idx, torch.empty(n, H, 512), scale=192**-0.5,
                                                    kv_lora_rank=512)  # fmt: skip
    with rec.group("mla", "aot fp32 pool H=12"):  # the TensorRT plugin's aot_impl (gpu_aot_check's shape)
        mla.aot_compile(12, 512, 64, 192**-0.5, 90, block_h=16)
    for name, pool in (("bf16", torch.bfloat16), ("fp8", torch.uint8)):  # K3's pools: h100x64 bf16, h200x32 fp8
        with rec.group("mla", f"aot {name} pool H=12"):
            mla.aot_compile(12, 512, 64, 192**-0.5, 90, block_h=16, pool_dtype=pool)


def case_sampler(rec: Recorder) -> None:
    from moe_export.runtime.engine import sampler_kernels as sk

    for name, (R, V) in (("k3 256x163840", (256, 163840)), ("tiny 3x1000", (3, 1000))):
        x = torch.empty(R, V)
        with rec.group("sampler", name):
            sk.argmax_rows(x)
            sk.sample_rows(x, torch.ones(R), torch.zeros(R, dtype=torch.int64), torch.ones(R), torch.zeros(R),
                           torch.zeros(R, dtype=torch.int64))  # fmt: skip


def case_transport(rec: Recorder) -> None:
    from moe_export.plugins.collectives import transport_kernels as tk

    for name, (T, k, ep, E, D, block_rows) in (("k3 ep64", (192, 16, 64, 896, 3584, 192)),
                                               ("tiny ep2", (4, 2, 2, 8, 64, 4))):  # fmt: skip
        ids = torch.zeros(T, k, dtype=torch.int64)
        with rec.group("transport", name):
            for rows in (block_rows, 0):
                tk.route(ids, torch.ones(1, dtype=torch.int64), E, ep, rows, torch.empty(ep, dtype=torch.int64),
                         torch.empty(T * k, dtype=torch.int64), torch.empty(E, dtype=torch.int64))  # fmt: skip
            row_bytes = D * 2 + 16 * k
            send = torch.empty(T * k, row_bytes, dtype=torch.uint8)
            x = torch.empty(T, D, dtype=torch.bfloat16)
            tk.pack(x, ids, torch.empty(T, k), torch.empty(T * k, dtype=torch.int64), send)
            recv_x, recv_ids, recv_w = (torch.empty(ep * block_rows, D, dtype=torch.bfloat16),
                                        torch.empty(ep * block_rows, k, dtype=torch.int64),
                                        torch.empty(ep * block_rows, k))  # fmt: skip
            counts = torch.empty(ep, dtype=torch.int64)
            for rows in (block_rows, 0):
                tk.unpack(torch.empty(ep * block_rows, row_bytes, dtype=torch.uint8), recv_x, recv_ids, recv_w,
                          counts, rows)  # fmt: skip
            tk.expand(torch.empty(ep * block_rows, D, dtype=torch.bfloat16), counts, block_rows,
                      torch.empty(ep * block_rows, D, dtype=torch.bfloat16))  # fmt: skip
            tk.sum_returned(torch.empty(T * k, D, dtype=torch.bfloat16), torch.empty(T * k, dtype=torch.int64),
                            torch.empty(T, D, dtype=torch.bfloat16))  # fmt: skip


def case_gds(rec: Recorder) -> None:
    from moe_export.plugins.gated_delta_scan import triton_kernel as gds

    for name, (H, K, N, lengths) in (("k3 decode 64 seqs H=12", (12, 128, 64, 1)),
                                     ("k3 prefill 1x8192 H=12", (12, 128, 1, 8192)),
                                     ("tiny", (2, 16, 3, 5))):  # fmt: skip
        T = N * lengths
        q = torch.empty(T, H, K, dtype=torch.bfloat16)
        with rec.group("gds", name):
            gds.launch(q, q, q, torch.empty(T, H, K), torch.empty(T, H), torch.zeros(1, 3, dtype=torch.int64), 0,
                       torch.arange(N + 1) * lengths, torch.arange(N), q, K**-0.5, True, True)  # fmt: skip
    with rec.group("gds", "aot bf16 H=12"):
        gds.aot_compile("bf16", 12, 128, 128, 128**-0.5, True, True, 90)


def case_conv(rec: Recorder) -> None:
    from moe_export.plugins.short_conv import triton_kernel as conv

    for name, (C, N, length) in (("k3 decode 64 seqs C=4608", (3 * 12 * 128, 64, 1)), ("tiny", (96, 3, 5))):
        T = N * length
        x = torch.empty(T, C, dtype=torch.bfloat16)
        with rec.group("conv", name):
            conv.launch(x, torch.empty(C, 4), torch.zeros(1, 3, dtype=torch.int64), 0, torch.arange(N + 1) * length,
                        torch.arange(N), x)  # fmt: skip
    with rec.group("conv", "aot bf16 C=4608"):
        conv.aot_compile("bf16", 3 * 12 * 128, 4, 90)


def case_cache_write(rec: Recorder) -> None:
    from moe_export.plugins.paged_cache_write import triton_kernel as write

    for dtype in (torch.uint8, torch.bfloat16):
        with rec.group("cache_write", f"k3 rows 576 pool={str(dtype)[6:]}"):
            write.paged_cache_write_launch(torch.zeros(1, 3, dtype=torch.int64), 0, 64, dtype, torch.empty(64, 576),
                                           torch.arange(65), torch.zeros(64, 4, dtype=torch.int64),
                                           torch.zeros(64, dtype=torch.int64), torch.empty(64, 576))  # fmt: skip
    with rec.group("cache_write", "aot fp8 rows 576"):
        write.aot_compile(576, 90, torch.uint8)


CASES = {"moe": case_moe, "indexer": case_indexer, "mla": case_mla, "sampler": case_sampler,
         "transport": case_transport, "gds": case_gds, "conv": case_conv, "cache_write": case_cache_write}  # fmt: skip


def _units(req: Request) -> tuple[str, int] | None:
    """(unit, units per inner-loop iteration) of the kernels that have a unit of work, from their constexprs."""
    c = req.constants()
    name = req.kernel
    if name in ("_moe_up_kernel", "_moe_down_kernel"):
        tiles = 2 if name == "_moe_up_kernel" else 1  # gate and up rows
        return "weight", tiles * c["BLOCK_N"] * c["BLOCK_K"]
    if name == "_sparse_mla_kernel":
        return "key row", c["BLOCK_K"]
    if name == "_index_scores_kernel":
        return "key row", c["BLOCK_N"]
    return None


# ----------------------------------------------------------------------------------------------------- compile

_MMA = {"wgmma": ("HGMMA",), "mma_sync": ("HMMA",), "cp_async": ("LDGSTS",),
        "cp_async_bulk": ("UBLKCP", "UTMALDG", "UTMAPF", "UTMASTG")}  # fmt: skip
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_text(cubin: bytes) -> str:
    """The cubin's SASS as Triton's cuobjdump prints it."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_BIN / "cuobjdump"), "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip


def sass_instructions(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every SASS instruction in cuobjdump's text."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _SASS_LINE.finditer(text)]


def inner_loop(sass: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The innermost loop (a backward BRA's target .. the branch) holding a matrix instruction, else one holding a
    global load; [] if none."""
    loops = []
    for addr, op, args in sass:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append([i for i in sass if int(target.group(1), 16) <= i[0] <= addr])
    for ops in (("HGMMA", "HMMA"), ("LDG", "LDGSTS", "UTMALDG")):
        holding = [body for body in loops if any(i[1].split(".")[0] in ops for i in body)]
        if holding:
            return min(holding, key=len)
    return []


def ptxas_log(ptx: str, fp_fusion: bool) -> str:
    """`ptxas -v` of the PTX with Triton's flags for sm_90a (stderr: registers, spills)."""
    ptxas = get_ptxas(TARGET.arch).path
    fmad = [] if fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        flags = ["-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", *fmad]
        run = subprocess.run([ptxas, *flags, str(src), "-o", str(Path(tmp, "k.o"))], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed: {run.stderr[-2000:]}")
    return run.stderr


def compile_request(req: Request) -> dict:
    """Compile the request for sm_90: Triton's metadata, the `ptxas -v` log and the SASS (what the cache holds)."""
    kernel = triton.compile(req.src, target=TARGET, options=req.options)
    meta = kernel.metadata
    return dict(num_warps=meta.num_warps, num_stages=meta.num_stages, shared=int(meta.shared),
                global_scratch=int(getattr(meta, "global_scratch_size", 0) or 0),
                profile_scratch=int(getattr(meta, "profile_scratch_size", 0) or 0),
                ptxas_log=ptxas_log(kernel.asm["ptx"], req.options.get("enable_fp_fusion", True)),
                sass=sass_text(kernel.asm["cubin"]))  # fmt: skip


def analyse(compiled: dict) -> dict:
    """The report's fields of one compiled kernel."""
    log = compiled["ptxas_log"]
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    sass = sass_instructions(compiled["sass"])
    ops = [op.split(".")[0] for _, op, _ in sass]
    row = {k: compiled[k] for k in ("num_warps", "num_stages", "shared", "global_scratch", "profile_scratch")}
    row.update(n_regs=int(regs.group(1)) if regs else 0, spill_stores=int(spills.group(1)) if spills else 0,
               spill_loads=int(spills.group(2)) if spills else 0, sass_instructions=len(sass))  # fmt: skip
    for key, names in _MMA.items():
        row[key] = sum(op in names for op in ops)
    row["local_loads"] = ops.count("LDL")
    loop = inner_loop(sass)
    row["loop_scope"] = "loop" if loop else "program"  # no loop: a program's whole body does its units once
    loop = loop or sass
    row["loop_instructions"] = len(loop)
    row["loop_local_loads"] = sum(op.startswith("LDL") for _, op, _ in loop)
    return row


def cached_compile(req: Request, cache: Path | None) -> dict:
    """`compile_request`, from the cache (gzip JSON named by `Request.key`) when the request was compiled before."""
    path = cache / f"{req.key()}.json.gz" if cache else None
    if path is not None and path.exists():
        return json.loads(gzip.decompress(path.read_bytes()))
    compiled = compile_request(req)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(gzip.compress(json.dumps(compiled).encode()))
        tmp.replace(path)
    return compiled


def report(groups: list[str], cache: Path | None) -> list[dict]:
    """One row per kernel and config of the chosen groups (cached results where the request is unchanged)."""
    rec = Recorder()
    for group in groups:
        CASES[group](rec)
    rows = []
    for req in rec.requests.values():
        row = dict(kernel=req.kernel, group=req.group, aot=req.aot, **analyse(cached_compile(req, cache)))
        threads = row["num_warps"] * 32
        units = _units(req)
        row["unit"], row["instructions_per_unit"] = None, None
        if units and row["loop_instructions"]:
            row["unit"] = units[0]
            row["instructions_per_unit"] = round(row["loop_instructions"] * threads / units[1], 3)
        row["constants"] = {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
                            for k, v in req.constants().items()}  # fmt: skip
        row["launches"] = req.launches
        rows.append(row)
    return rows


def report_in_processes(groups: list[str], cache: str, jobs: int) -> list[dict]:
    """`report` of each group in its own process (`jobs` at once: compiling is single-threaded), rows in group
    order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(group: str) -> list[dict]:
        run = subprocess.run([sys.executable, __file__, "--json", "--jobs", "1", "--kernels", group, "--cache", cache],
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            raise RuntimeError(f"sm90_report --kernels {group} failed:\n{run.stderr[-3000:]}")
        return json.loads(run.stdout)

    with ThreadPoolExecutor(jobs) as pool:
        return [row for rows in pool.map(one, groups) for row in rows]


_COLUMNS = ("kernel", "case", "warps", "stages", "regs", "spill st/ld", "shared", "wgmma", "mma.sync", "cp.async",
            "bulk", "per unit", "programs")  # fmt: skip


def table(rows: list[dict]) -> str:
    """The report as a Markdown table (one row per kernel and config; its first case named, with its programs)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in rows:
        cases = r["launches"][0]["case"] + (f" (+{len(r['launches']) - 1})" if len(r["launches"]) > 1 else "")
        per = f"{r['instructions_per_unit']:.2f} / {r['unit']}" if r["unit"] else "-"
        kernel = r["kernel"] + (" (AOT)" if r["aot"] else "")
        cells = (kernel, f"{r['group']}: {cases}", r["num_warps"], r["num_stages"], r["n_regs"],
                 f"{r['spill_stores']} / {r['spill_loads']}", r["shared"], r["wgmma"], r["mma_sync"], r["cp_async"],
                 r["cp_async_bulk"], per, r["launches"][0]["programs"] or "-")  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON document: the list of rows")
    parser.add_argument("--kernels", default=",".join(GROUPS), help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "moe_export" / "sm90_report"),
                        help="folder of cached results ('' for none)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=min(len(GROUPS), os.cpu_count() or 1),
                        help="groups compiled at once, each in its own process (default: one per CPU)")  # fmt: skip
    args = parser.parse_args()
    groups = [g.strip() for g in args.kernels.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        sys.exit(f"sm90_report: unknown kernel group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    if args.jobs > 1 and len(groups) > 1:
        rows = report_in_processes(groups, args.cache, args.jobs)
    else:
        rows = report(groups, Path(args.cache) if args.cache else None)
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
