"""CpuKernels: the few loops torch has no op for, compiled once with the system's C++ compiler.

References: vLLM's CPU paged attention (`csrc/cpu/attention.cpp`: one query per decode
sequence, K/V read through the block table where they lie), llama.cpp's `ggml_vec_dot_*`
and `ggml_v_expf` (plain loops the compiler vectorises; a polynomial exp), Cephes `expf`.

`decode_attention` is what a decode step needs from attention: for each sequence one
query row per head, against the K/V of its blocks, read in place. In torch that takes a gather
of every sequence's blocks into a contiguous buffer in every layer (attention.py's fallback);
here each K/V row is read once, where the block table says it is.

The C++ lives in kernels/ beside this module (package data: layer_kernels.cpp and the
headers it includes, vec16.h, qdot.h, qdot_input.h and paged_attention.h; int8_rows.cpp for
Int8Matrix, lora_rows.cpp for LoRA adapters). It is
compiled on first use from where it lies, so a compiler error names the real file and line,
into ~/.cache/llmq/kernels (LLMQ_KERNEL_DIR), keyed by a hash of every source file, the
compiler, the flags and the CPU model, and loaded with ctypes (no torch headers, no ninja):
~13 s at -O3 on one core, once per machine and source version, shared by every process.
Where there is no compiler (slim images) or LLMQ_CPU_KERNELS=0, `load()` returns None and the
engine runs the torch path: same results to float32 rounding.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .int8_matrix import Int8Matrix

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # a function of a loaded library, as typeshed names it

    from .quant_matrix import QuantMatrix

logger = logging.getLogger(__name__)

# The kernels' C++ (package data: pyproject.toml ships kernels/*.cpp and kernels/*.h).
KERNEL_DIR = Path(__file__).resolve().with_name("kernels")

_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared",
          "-std=c++17"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""


def kernel_sources(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    """The C++ files of the kernels: every .cpp (one translation unit each) and .h in
    `kernel_dir`. FileNotFoundError names the folder when there is none."""
    sources = sorted(p for p in kernel_dir.glob("*") if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in sources):
        raise FileNotFoundError(f"no kernel sources (*.cpp) in {kernel_dir}: the package was "
                                "installed without its data files")
    return sources


def build_key(compiler: str, sources: list[Path]) -> str:
    """The cache key of a build: any change to a source file (its name or a byte), the compiler,
    the flags or the CPU gives another library file. Where the package lies is not part of it:
    the library does not depend on it."""
    digest = hashlib.sha256()
    for part in [compiler, *_FLAGS, _cpu_model()]:
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_library(directory: Path, kernel_dir: Path = KERNEL_DIR) -> Path | None:
    """The compiled kernels in `directory` (built there first if missing), or None when there
    is no compiler or the build failed (the compiler's first messages are logged)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None
    sources = kernel_sources(kernel_dir)
    target = directory / f"llmq_kernels_{build_key(compiler, sources)}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # NOTE: one build at a time: workers starting together on a new CPU wait for the first
    # one's build (a minute or more on 2 cores) rather than each compiling beside it, which
    # on an AVX2 host took them all past the timeout.
    with open(directory / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        return _compile(compiler, sources, directory, target)


def _compile(compiler: str, sources: list[Path], directory: Path, target: Path) -> Path | None:
    logger.info("compiling the CPU kernels for this CPU into %s (once per CPU and version)",
                directory)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / target.name
        # NOTE: the package's files compiled where they lie (not copied), so a compiler message
        # names the file and line to open.
        units = [str(p) for p in sources if p.suffix == ".cpp"]
        result = subprocess.run([compiler, *_FLAGS, *units, "-o", str(built)],
                                capture_output=True, text=True, timeout=900)
        if result.returncode:
            # NOTE: the first error leads; what follows it is often its echo.
            logger.warning("CPU kernels did not compile (%s):\n%s", compiler,
                           result.stderr.strip()[:2000])
            return None
        # NOTE: a rename, so a worker starting beside us never loads a half-written file.
        os.replace(built, target)
    logger.info("compiled the CPU kernels in %.0f s", time.monotonic() - started)
    return target


INT8_CHUNK_ROWS = 256  # rows of x per int8 GEMM (CpuKernels.int8_matmul says why)


class QMat(ctypes.Structure):
    """The kernels' view of a QuantMatrix (kernels/layer_kernels.cpp `QMat`)."""

    _fields_ = [("q", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("group", ctypes.c_int64), ("bits", ctypes.c_int32), ("dot", ctypes.c_int32),
                ("unit", ctypes.c_float), ("unused", ctypes.c_int32), ("next", ctypes.c_void_p)]


class DecoderLayer(ctypes.Structure):
    """One layer for `CpuKernels.decode_layers` (kernels/layer_kernels.cpp `DecoderLayer`)."""

    _fields_ = [("qkv", QMat), ("o", QMat), ("gate_up", QMat), ("down", QMat),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("cache", ctypes.c_void_p)]


class LoraBlock(ctypes.Structure):
    """One part of a fused LoRA projection (kernels/lora_rows.cpp `LoraBlock`): its B
    [rank, cols] and where it reads xa and writes y."""

    _fields_ = [("b", ctypes.c_void_p), ("rank_offset", ctypes.c_int64),
                ("rank", ctypes.c_int64), ("col_start", ctypes.c_int64), ("cols", ctypes.c_int64)]


class LoraProj(ctypes.Structure):
    """One adapter's pair for one projection (kernels/lora_rows.cpp `LoraProj`); a null `a`:
    the adapter leaves that projection alone."""

    _fields_ = [("a", ctypes.c_void_p), ("in_features", ctypes.c_int64),
                ("rank_padded", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
                ("blocks", LoraBlock * 3)]


class LoraSegment(ctypes.Structure):
    """Rows [start, end) of a step under one adapter (kernels/lora_rows.cpp `LoraSegment`):
    `table` points at the adapter's LoraProj array of `table_len` projections."""

    _fields_ = [("start", ctypes.c_int64), ("end", ctypes.c_int64), ("table", ctypes.c_void_p),
                ("table_len", ctypes.c_int64)]


class CpuKernels:
    """The compiled kernels behind typed Python wrappers; `load()` builds them once."""

    MAX_GROUP = 8  # decode_attention has kernels for up to 8 query heads per kv head
    MAX_QUANT_ROWS = 8  # quant_matmul has kernels for up to 8 rows

    _instance: CpuKernels | None = None
    _tried = False
    build_id = ""  # the library's name (its build key): form_choice.py keys its file by it

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
        self._decode_attention = _bind(
            library.llmq_decode_attention,
            [ptr, i64, ptr, i32, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr, i32],
            ctypes.c_int32)
        self._prompt_attention = _bind(
            library.llmq_prompt_attention,
            [ptr, i64, ptr, i32, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, ptr, i32],
            ctypes.c_int32)
        self._add_rms_norm = _bind(library.llmq_add_rms_norm,
                                   [ptr, ptr, i32, ptr, i64, i64, f32, ptr, i32])
        self._silu_mul = _bind(library.llmq_silu_mul, [ptr, i32, i64, i64, ptr, i32])
        self._quant_matmul = _bind(library.llmq_quant_matmul,
                                   [ptr, i64, i64, ptr, ptr, i64], ctypes.c_int32)
        self._decode_layers = _bind(
            library.llmq_decode_layers,
            [ptr, i64, ptr, i64, i64, i64, ptr, f32, i64, i64, i64, i64, i64, i32, ptr, ptr,
             ptr, ptr, ptr, i64, ptr, f32, ptr], ctypes.c_int32)
        self._rope_store = _bind(
            library.llmq_rope_store,
            [ptr, i32, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i32, i64, i64, ptr, ptr])
        self._quantize_rows_x2 = _bind(library.llmq_quantize_rows_x2,
                                       [ptr, i64, i64, i64, ptr, ptr])
        self._dequantize_rows_x2 = _bind(library.llmq_dequantize_rows_x2,
                                         [ptr, i64, i64, ptr, ptr, ptr, ptr, i64])
        self._lora_add = _bind(library.llmq_lora_add, [ptr, i32, i64, ptr, i32, i64, ptr, i64, i64])

    @classmethod
    def load(cls) -> CpuKernels | None:
        """The kernels, or None (logged once) when they cannot be built here."""
        if cls._tried:
            return cls._instance
        cls._tried = True
        if os.environ.get("LLMQ_CPU_KERNELS", "1") == "0":
            return None
        directory = Path(os.environ.get("LLMQ_KERNEL_DIR")
                         or Path.home() / ".cache" / "llmq" / "kernels")
        try:
            path = build_library(directory)
            if path is not None:
                cls._instance = cls(ctypes.CDLL(str(path)))
                cls._instance.build_id = path.stem
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("CPU kernels unavailable: %s", e)
        if cls._instance is None:
            logger.warning("no CPU kernels (no C++ compiler, or it failed): the engine runs "
                           "plain torch ops instead (slower, same results to rounding)")
        return cls._instance

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         out: torch.Tensor) -> torch.Tensor:
        """q [num_seqs, num_heads, hd] float32 (rows may be strided, each contiguous);
        kv_cache [2, num_kv_heads, num_blocks, block_size, hd]; block_tables [num_seqs,
        max_blocks] int64 (entries past a sequence's length are never read); seq_lens
        [num_seqs] int64. Fills and returns out [num_seqs, num_heads, hd]."""
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        num_seqs, num_heads, _ = q.shape
        _check(kv_cache, block_tables, seq_lens, out)
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("decode_attention: q must be float32 with contiguous rows")
        done = self._decode_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), _is_bf16(kv_cache),
            block_tables.data_ptr(), seq_lens.data_ptr(), num_seqs, block_tables.shape[1],
            num_heads, num_kv_heads, num_blocks, block_size, head_dim, scale, out.data_ptr(),
            _is_bf16(out))
        if not done:
            raise ValueError(f"decode_attention: no kernel for {num_heads // num_kv_heads} "
                             "query heads per kv head")
        return out

    def prompt_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         block_tables: torch.Tensor, starts: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Causal attention of prompts' query rows over the cache (which already holds their
        K/V): sequence s's rows are q[starts[s]:starts[s + 1]], its last row at position
        seq_lens[s] - 1. Each row gets the very floats decode_attention gives it alone.
        q [tokens, num_heads, hd] float32 (rows may be strided, each contiguous); block_tables
        [num_seqs, max_blocks], starts [num_seqs + 1], seq_lens [num_seqs] int64. Fills
        out [tokens, num_heads, hd] (rows starts[0]..starts[-1]) and returns it."""
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        num_heads = q.shape[1]
        _check(kv_cache, block_tables, starts, seq_lens, out)
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("prompt_attention: q must be float32 with contiguous rows")
        done = self._prompt_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), _is_bf16(kv_cache),
            block_tables.data_ptr(), starts.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], block_tables.shape[1], num_heads, num_kv_heads, num_blocks,
            block_size, head_dim, scale, out.data_ptr(), _is_bf16(out))
        if not done:
            raise ValueError(f"prompt_attention: no kernel for {num_heads // num_kv_heads} "
                             "query heads per kv head")
        return out

    def quant_matmul(self, x: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
        """x [rows, in] float32 -> x W^T [rows, out] float32, in float32 arithmetic (a `dot`
        matrix: x in int8, kernels/qdot.h); more than MAX_QUANT_ROWS rows on float32 tiles run
        as calls of that many (the kernels' largest), each row's numbers the same whatever
        shares its call."""
        rows = x.shape[0]
        y = torch.empty(rows, w.out_features)
        if x.dtype != torch.float32 or x.stride(1) != 1:
            raise ValueError("quant_matmul: x must be float32 with contiguous rows")
        # NOTE: the qdot kernel takes any rows in one call (it reads W once for all of them)
        most = max(rows, 1) if w.dot else self.MAX_QUANT_ROWS
        for start in range(0, rows, most):
            part = min(most, rows - start)
            if not self._quant_matmul(x[start].data_ptr(), x.stride(0), part,
                                      ctypes.byref(w.struct), y[start].data_ptr(), y.stride(0)):
                raise ValueError(f"quant_matmul: no kernel for {part} rows, {w.bits}-bit "
                                 f"groups of {w.group}")
        return y

    def int8_matmul(self, x: torch.Tensor, w: Int8Matrix) -> torch.Tensor:
        """x [rows, in] float32 -> x W^T (+ bias) [rows, out] float32 through torch's int8
        GEMM: each row of x as two int8 terms, W int8 per output channel (int8_matrix.py)."""
        rows, k = x.shape
        if x.dtype != torch.float32 or x.stride(1) != 1:
            raise ValueError("int8_matmul: x must be float32 with contiguous rows")
        y = torch.empty(rows, w.out_features)
        chunk = min(rows, INT8_CHUNK_ROWS)
        q = torch.empty(2 * chunk, k, dtype=torch.int8)
        scales = torch.empty(2 * chunk)
        bias = 0 if w.bias is None else w.bias.data_ptr()
        # NOTE: in chunks of rows: a prefill's whole int32 product ([2 x 1024, 3072] is 24 MiB)
        # would leave the cache before it is read back (measured ~15% slower GEMMs).
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            self._quantize_rows_x2(x[start].data_ptr(), x.stride(0), n, k, q.data_ptr(),
                                   scales.data_ptr())
            acc = torch._int_mm(q[:2 * n], w.q.t())  # [2n, out] int32
            self._dequantize_rows_x2(acc.data_ptr(), n, w.out_features, scales.data_ptr(),
                                     w.scale.data_ptr(), bias, y[start].data_ptr(), y.stride(0))
        return y

    def lora_add(self, x: torch.Tensor, y: torch.Tensor,
                 segments: ctypes.Array[LoraSegment], projection: int) -> None:
        """y[rows] += x[rows] A B (in place) for every segment whose adapter's table has
        `projection`. x [rows, in], y [rows, out]: float32 or bfloat16, contiguous rows."""
        if x.stride(1) != 1 or y.stride(1) != 1 or not {x.dtype, y.dtype} <= _FLOAT:
            raise ValueError(f"lora_add: x and y need float32/bfloat16 contiguous rows, got "
                             f"{x.dtype} {x.stride()} and {y.dtype} {y.stride()}")
        self._lora_add(x.data_ptr(), _is_bf16(x), x.stride(0), y.data_ptr(), _is_bf16(y),
                       y.stride(0), segments, len(segments), projection)

    def decode_layers(self, layers: ctypes.Array[DecoderLayer], h: torch.Tensor,
                      intermediate_size: int, final_norm: torch.Tensor, eps: float, num_heads: int,
                      kv_cache: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, first: int = 0,
                      count: int | None = None) -> torch.Tensor | None:
        """The layers [first, first + count) (default: all) of a decode step in one call
        (DecoderLayer array, one per layer, all projections QuantMatrix: up to 8 rows, any
        number where all are qdot's). h [rows, hidden] float32: the embedded tokens, or the
        residual stream after layer first - 1, updated in place. final_norm: the norm after
        the last of them (the next layer's input norm, or the model's). kv_cache: layer 0's
        cache (all share its shape and dtype). Returns h normed by final_norm, or None if some
        shape has no kernel."""
        rows, hidden = h.shape
        _, kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        count = len(layers) - first if count is None else count
        if not (0 <= first and 0 < count and first + count <= len(layers)):
            raise ValueError(f"decode_layers: layers [{first}, {first + count}) of {len(layers)}")
        out = torch.empty(rows, hidden)
        _check(h, final_norm, positions, cos, sin, slot_mapping, block_tables, seq_lens)
        done = self._decode_layers(
            ctypes.byref(layers, first * ctypes.sizeof(DecoderLayer)), count, h.data_ptr(),
            rows, hidden, intermediate_size,
            final_norm.data_ptr(), eps, num_heads, kv_heads, head_dim, num_blocks, block_size,
            _is_bf16(kv_cache), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), scale, out.data_ptr())
        return out if done else None

    def add_rms_norm(self, h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """h [rows, dim] float32 (+= y in place when given; y float32 or bfloat16), then
        RMSNorm(h) * weight -> a new [rows, dim] tensor of out_dtype."""
        rows, dim = h.shape
        out = torch.empty(rows, dim, dtype=out_dtype)
        _check(h, y, weight)
        if h.dtype != torch.float32 or weight.dtype != torch.float32:
            raise ValueError("add_rms_norm: h and weight must be float32")
        self._add_rms_norm(h.data_ptr(), 0 if y is None else y.data_ptr(),
                           int(y is not None and _is_bf16(y)), weight.data_ptr(),
                           rows, dim, eps, out.data_ptr(), int(out_dtype == torch.bfloat16))
        return out

    def silu_mul(self, gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """gate_up [rows, 2 * dim] -> silu(gate) * up [rows, dim] of out_dtype."""
        rows, two_dim = gate_up.shape
        out = torch.empty(rows, two_dim // 2, dtype=out_dtype)
        _check(gate_up)
        self._silu_mul(gate_up.data_ptr(), _is_bf16(gate_up), rows,
                       two_dim // 2, out.data_ptr(), int(out_dtype == torch.bfloat16))
        return out

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache: torch.Tensor, with_kv: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qkv [tokens, (heads + 2 * kv_heads) * hd] (interleaved-RoPE Q/K order) -> q
        [tokens, heads, hd] float32 rotated, and (with_kv) kv [tokens, 2 * kv_heads, hd]
        float32 as the cache holds it; K rotated and V are written into their slots of
        kv_cache [2, kv_heads, num_blocks, block_size, hd]. cos/sin [positions, hd / 2]."""
        tokens = qkv.shape[0]
        head_dim = kv_cache.shape[-1]
        q = torch.empty(tokens, num_heads, head_dim)
        kv = torch.empty(tokens, 2 * num_kv_heads, head_dim) if with_kv else None
        _check(positions, cos, sin, slot_mapping, kv_cache)
        if qkv.stride(1) != 1:
            raise ValueError("rope_store: qkv rows must be contiguous")
        self._rope_store(qkv.data_ptr(), _is_bf16(qkv), qkv.stride(0),
                         tokens, num_heads, num_kv_heads, head_dim, positions.data_ptr(),
                         cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                         kv_cache.data_ptr(), _is_bf16(kv_cache),
                         kv_cache.shape[2] * kv_cache.shape[3], kv_cache.shape[3], q.data_ptr(),
                         0 if kv is None else kv.data_ptr())
        return q, kv


def _bind(fn: CFuncPtr, argtypes: list[Any], restype: Any = None) -> CFuncPtr:
    """`fn` with its C signature set, so ctypes converts (and checks) the arguments."""
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _check(*tensors: torch.Tensor | None) -> None:
    """The kernels take raw pointers: every tensor must be contiguous, of a supported dtype."""
    for t in tensors:
        if t is not None and (not t.is_contiguous() or t.dtype not in _INDEX_OR_FLOAT):
            raise ValueError(f"CPU kernels need contiguous float32/bfloat16/int64 tensors, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


_FLOAT = {torch.float32, torch.bfloat16}
_INDEX_OR_FLOAT = (torch.float32, torch.bfloat16, torch.int64)
