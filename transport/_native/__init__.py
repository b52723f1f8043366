"""Optional C kernels for the block codecs, compiled on first use and cached per machine.

Run their tests with: `.venv/bin/python -m pytest -q tests/transport/test_codecs.py`

`blockquant()` returns the kernels of `blockquant.c` (int8, int4 and fp8, float32 on CPU),
or None, after which the codecs keep their torch path. The first call in a process
compiles the source with the C compiler (`$CC`, else `cc`, `gcc` or `clang`; about a
second) into `$ACTORPIPE_CACHE_DIR`, default `~/.cache/actorpipe`, under a
file lock, so concurrent processes compile once between them; later processes only
load the cached library. A missing compiler or a failed build logs one warning.
`ACTORPIPE_NATIVE=0` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from transport._buffers import aligned_empty

__all__ = ["KINDS", "BlockQuantKernels", "blockquant"]

KINDS = ("int8", "int4", "fp8")  # the codecs with kernels here

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("blockquant.c")
# -ffp-contract=off: every float operation must round as torch's separate ops do.
_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")
# Tried in order: without target_clones for compilers or C libraries that lack them.
_VARIANTS = ((), ("-DACTORPIPE_NO_CLONES",))
_COMPILE_TIMEOUT_S = 120.0
# Decoded outputs from this size up bypass the caches (non-temporal stores): larger than
# a core's L2, they would be evicted anyway, and skipping the read of each line first
# made int8 encode+decode of 16 MiB ~25% faster here. Smaller ones stay cached for
# whoever reads them next.
STREAM_MIN_BYTES = 4 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockQuantKernels:
    """The compiled kernels, wrapped to take and return tensors.

    Attributes:
        path: The shared library they were loaded from.
    """

    path: Path
    _functions: dict[str, Callable[..., None]]

    def encode(
        self, flat: torch.Tensor, *, kind: str, block: int, floor: float, ceil: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize a 1-D contiguous float32 CPU tensor to ``kind``: ``int8``, ``int4`` or ``fp8`` (e4m3).

        Returns:
            The values frame (uint8: numel bytes, or int4's (numel + 1) // 2) and the
            float32 scales, one per block, both freshly allocated.
        """
        assert flat.dtype == torch.float32 and flat.device.type == "cpu"
        assert flat.dim() == 1 and flat.is_contiguous() and (kind != "int4" or block % 2 == 0)
        numel = flat.numel()
        values = aligned_empty(_values_bytes(kind, numel))
        scales = torch.empty(-(-numel // block), dtype=torch.float32)
        if numel:
            self._functions[f"encode_{kind}"](
                flat.data_ptr(), numel, block, floor, ceil, values.data_ptr(), scales.data_ptr()
            )
        return values, scales

    def decode(
        self, values: torch.Tensor, scales: torch.Tensor, *, kind: str, numel: int, block: int
    ) -> torch.Tensor:
        """Dequantize frames `encode` made (sizes already checked) to float32 [numel]."""
        assert values.dtype == torch.uint8 and scales.dtype == torch.float32
        assert values.is_contiguous() and scales.is_contiguous()
        assert values.numel() == _values_bytes(kind, numel)
        assert scales.numel() == -(-numel // block)
        out = aligned_empty(numel * 4).view(torch.float32)
        if numel:
            self._functions[f"decode_{kind}"](
                values.data_ptr(), scales.data_ptr(), numel, block, out.data_ptr(),
                numel * 4 >= STREAM_MIN_BYTES,
            )
        return out


def _values_bytes(kind: str, numel: int) -> int:
    return (numel + 1) // 2 if kind == "int4" else numel


_lock = threading.Lock()
_loaded: list[BlockQuantKernels | None] = []  # empty until the first call


def blockquant() -> BlockQuantKernels | None:
    """Return the block kernels, compiling them on the first call; None if unavailable."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_load())
    return _loaded[0]


def _load() -> BlockQuantKernels | None:
    if os.environ.get("ACTORPIPE_NATIVE", "1") == "0":
        return None
    compiler = _find_compiler()
    if compiler is None:
        _log.warning("no C compiler found ($CC, cc, gcc, clang): the int8, int4 and fp8 codecs "
                     "use their slower torch path; install gcc to speed them up")
        return None
    try:
        path = _build(compiler)
        return _bind(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        _log.warning("building %s failed, so the int8, int4 and fp8 codecs use their slower "
                     "torch path: %s", _SOURCE.name, error)
        return None


def _find_compiler() -> list[str] | None:
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cache_dir() -> Path:
    if os.environ.get("ACTORPIPE_CACHE_DIR"):
        return Path(os.environ["ACTORPIPE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "actorpipe"


def _build(compiler: list[str]) -> Path:
    """Return the cached shared library for this source and compiler, compiling it if new.

    Raises:
        OSError: The cache directory is not writable, or the library does not load.
        subprocess.SubprocessError: Every compile variant failed or timed out.
    """
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, *map(str.encode, compiler + list(_FLAGS)),
                    platform.machine().encode(), sys.platform.encode()])
    ).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"blockquant-{key}.so"
    if library.exists():
        return library
    with open(directory / f"blockquant-{key}.lock", "w") as lock_file:
        _lock_file(lock_file)  # released when the file closes
        if library.exists():  # another process built it while we waited
            return library
        partial = directory / f"blockquant-{key}.{os.getpid()}.tmp"
        errors = []
        for variant in _VARIANTS:
            command = [*compiler, *_FLAGS, *variant, str(_SOURCE), "-o", str(partial), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, errors="replace",
                                    timeout=_COMPILE_TIMEOUT_S)
            if result.returncode == 0:
                os.replace(partial, library)  # atomic: readers never see a partial file
                return library
            errors.append(f"{shlex.join(command)}: {result.stderr.strip()[-500:]}")
        partial.unlink(missing_ok=True)
        raise subprocess.SubprocessError("; ".join(errors))


def _lock_file(lock_file: IO[str]) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps concurrent builds safe
        return
    fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)


def _bind(library: ctypes.CDLL, path: Path) -> BlockQuantKernels:
    pointer, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    encode_args = [pointer, i64, i64, f32, f32, pointer, pointer]
    decode_args = [pointer, pointer, i64, i64, pointer, ctypes.c_int32]
    functions = {}
    for name, args in ((f"{way}_{kind}", encode_args if way == "encode" else decode_args)
                       for kind in KINDS for way in ("encode", "decode")):
        function = getattr(library, f"actorpipe_{name}")
        function.argtypes, function.restype = args, None
        functions[name] = function
    return BlockQuantKernels(path=path, _functions=functions)
