"""``PYTORCH_CUDA_ALLOC_CONF``: the caching allocator's constants, its settings and how request sizes
round (torch 2.13's c10/core/AllocatorConfig.h and .cpp, c10/cuda/CUDAAllocatorConfig.h and .cpp; each
rule cites its source lines, see `trainmem_nb.engine.allocator`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["VALID_KEYS", "AllocatorConfig", "get_allocation_size", "kLargeBuffer", "kMinBlockSize", "kMinLargeAlloc",
           "kRoundLarge", "kSmallBuffer", "kSmallSize", "parse_alloc_conf", "round_size", "roundup_power2_next_division"]

# --------------------------------------------------------------------------------------------
# Constants: AC.h:16-25 (torch 2.13 header) ("all sizes are rounded to at least 512 bytes", ...)
# --------------------------------------------------------------------------------------------
kMinBlockSize = 512             # AC.h:19  constexpr size_t kMinBlockSize = 512;
kSmallSize = 1048576            # AC.h:21  largest "small" allocation is 1 MiB
kSmallBuffer = 2097152          # AC.h:17  "small" allocations are packed in 2 MiB blocks
kMinLargeAlloc = 10485760       # AC.h:23  allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152           # AC.h:25  round up large allocations to 2 MiB
kLargeBuffer = 20971520         # AC.h:340 large_segment_size_{20971520}; // 20 MB by default
SIZE_MAX = (1 << 64) - 1        # AC.h:342 max_split_size_{std::numeric_limits<size_t>::max()}
MB = 1 << 20
_KEY_SHIFT = 56                 # pool key = size << 56 | address  (addresses stay < 2**56)
_ADDR_BASE = 0x7F0000000000     # synthetic device addresses (cudaMalloc's are opaque to us)
_ADDR_ALIGN = kSmallBuffer      # cudaMalloc'd / reserved VA ranges are 2 MiB aligned here
_DEFAULT_TOTAL = 1 << 40        # device memory assumed for expandable VA sizing when unknown

# ============================================================================================
# Configuration: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF
# ============================================================================================

# AC.cpp:20-31 (AcceleratorAllocatorConfig::getMutableKeys) ...
_ACCELERATOR_KEYS = (
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
    "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
)
# ... plus CAC.h:158-177 (CUDAAllocatorConfig::getKeys, torch 2.13 header); an unknown key is
# rejected by CAC.cpp:125-131 "Unrecognized key '...' in CUDA allocator config."
_CUDA_KEYS = (
    "backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc", "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb", "pinned_num_register_threads", "per_process_memory_fraction",
    "pinned_free_catch_all", "throw_on_cudamalloc_oom",
)
VALID_KEYS = tuple(sorted(_ACCELERATOR_KEYS + _CUDA_KEYS))


@dataclass(frozen=True)
class AllocatorConfig:
    """Parsed allocator settings; sizes in bytes. Defaults are the C++ defaults (AC.h:340-353,
    CAC.h:210-225). Keys that only affect the pinned/host allocator, locking or graph capture are
    parsed and validated but do not change device reserved memory."""
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = kLargeBuffer
    large_segment_size: int = kLargeBuffer
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple = (0,) * 16
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    release_lock_on_cudamalloc: bool = False
    graph_capture_record_stream_reuse: bool = False
    throw_on_cudamalloc_oom: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_reserve_segment_size_mb: int = 0
    pinned_free_catch_all: bool = False
    pinned_use_background_threads: bool = False
    pinned_max_round_threshold: int = SIZE_MAX
    pinned_max_cached_size: int = SIZE_MAX
    source: str = field(default="", compare=False)


def _tokenize(env: str) -> list:
    # AC.h:35-53 ConfigTokenizer: ',' ':' '[' ']' are tokens, whitespace dropped
    out: list = []
    buf: list = []
    for ch in env:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


class _Tok:
    def __init__(self, env: str):
        self.t = _tokenize(env)

    def get(self, i: int, what: str) -> str:
        if i >= len(self.t):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected {what} at end of config")
        return self.t[i]

    def expect(self, i: int, tok: str, key: str) -> None:
        # AC.h:65-68 checkToken (the C++ ignores the result; this model is strict)
        got = self.get(i, repr(tok))
        if got != tok:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected {tok!r} after {key!r}, got {got!r}")

    def size_t(self, i: int, key: str) -> int:
        # AC.h:70-73 toSizeT = std::stoull (which would also take '12abc' as 12; strict here)
        s = self.get(i, f"a value for {key!r}")
        if not s.isdigit():
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects a non-negative integer, got {s!r}")
        return int(s)

    def double(self, i: int, key: str) -> float:
        s = self.get(i, f"a value for {key!r}")  # AC.h:75-78 toDouble = std::stod
        try:
            return float(s)
        except ValueError:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects a number, got {s!r}") from None

    def boolean(self, i: int, key: str) -> bool:
        s = self.get(i, f"a value for {key!r}")  # AC.h:80-96 toBool: exactly 'True' or 'False'
        if s == "True":
            return True
        if s == "False":
            return False
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key} expects 'True' or 'False', got {s!r}")

    def skip(self, i: int, key: str) -> int:
        # AC.h:100-121 skipKey
        self.expect(i + 1, ":", key)
        i += 2
        if self.get(i, f"a value for {key!r}") != "[":
            return i
        while i + 1 < len(self.t) and self.t[i + 1] != "]":
            i += 1
        if i + 1 >= len(self.t):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {key}: missing ']'")
        return i + 1


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def parse_alloc_conf(env: str | None) -> AllocatorConfig:
    """Parse a PYTORCH_CUDA_ALLOC_CONF string the way torch 2.13 does (AC.cpp:266-329 then
    CAC.cpp:73-146). Unknown keys and invalid values raise ``ValueError``."""
    if env is None or env.strip() == "":
        return AllocatorConfig(source=env or "")
    tk = _Tok(env)
    t = tk.t
    vals: dict = {}
    # AC.cpp:280-288: large_segment_size_mb is read first, max_non_split_rounding defaults to it
    large = kLargeBuffer
    for i, key in enumerate(t):
        if key == "large_segment_size_mb" and (i == 0 or t[i - 1] == ","):
            tk.expect(i + 1, ":", key)
            v = tk.size_t(i + 2, key)
            if not v > kMinLargeAlloc // MB:  # AC.cpp:99-103 "must be > 10 MB"
                raise ValueError(f"large_segment_size_mb must be > {kMinLargeAlloc // MB} MB, got {v}")
            large = min(v, SIZE_MAX // MB) * MB
    vals["large_segment_size"] = large
    vals["max_non_split_rounding_size"] = large          # AC.cpp:288
    divisions = [0] * 16
    i = 0
    n = len(t)
    while i < n:
        key = t[i]
        if key == "large_segment_size_mb":
            i = tk.skip(i, key)                          # AC.cpp:293-294 handled previously
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            tk.expect(i + 1, ":", key)
            v = tk.size_t(i + 2, key)
            lo = large // MB                             # AC.cpp:114 / :133 min = large_segment_size
            if v < lo:                                   # AC.cpp:119-122 / :138-141
                raise ValueError(f"CachingAllocator option {key} too small, must be >= {lo}, got {v}")
            v = min(v, SIZE_MAX // MB) * MB
            vals["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"] = v
            i += 2
        elif key == "garbage_collection_threshold":
            tk.expect(i + 1, ":", key)
            fv = tk.double(i + 2, key)
            if not (0.0 < fv < 1.0):                      # AC.cpp:153-155 "set it in (0.0, 1.0)"
                raise ValueError(f"garbage_collection_threshold is invalid, set it in (0.0, 1.0), got {fv}")
            vals["garbage_collection_threshold"] = fv
            i += 2
        elif key == "roundup_power2_divisions":
            i = _parse_roundup(tk, i, divisions)
        elif key in ("expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                     "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                     "graph_capture_record_stream_reuse", "pinned_free_catch_all",
                     "throw_on_cudamalloc_oom", "pinned_use_background_threads"):
            tk.expect(i + 1, ":", key)
            b = tk.boolean(i + 2, key)                   # AC.cpp:228-234, CAC.cpp:91 etc.
            name = {"release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
                    "pinned_use_hip_host_register": "pinned_use_cuda_host_register"}.get(key, key)
            vals[name] = b
            i += 2
        elif key == "per_process_memory_fraction":
            tk.expect(i + 1, ":", key)
            fv = tk.double(i + 2, key)
            if not (0.0 <= fv <= 1.0):                    # CAC.cpp:169-172 "[0.0, 1.0]"
                raise ValueError(f"per_process_memory_fraction is invalid, set it in [0.0, 1.0], got {fv}")
            vals[key] = fv
            i += 2
        elif key == "backend":
            tk.expect(i + 1, ":", key)
            bk = tk.get(i + 2, "a backend")
            if bk == "cudaMallocAsync":                   # CAC.cpp:57-60 accepted by torch, not modelled
                raise ValueError("backend:cudaMallocAsync is valid for torch but not modelled here "
                                 "(this is a model of the native caching allocator)")
            if bk != "native":
                raise ValueError(f"Unknown allocator backend {bk!r}, options are native and cudaMallocAsync")
            i += 2
        elif key == "pinned_num_register_threads":
            tk.expect(i + 1, ":", key)
            v = tk.size_t(i + 2, key)
            if not _is_pow2(v) or v > 128:               # CAC.cpp / CAC.h:97-102 (max 128)
                raise ValueError(f"pinned_num_register_threads must be a power of 2 <= 128, got {v}")
            vals[key] = v
            i += 2
        elif key == "pinned_reserve_segment_size_mb":
            tk.expect(i + 1, ":", key)
            v = tk.size_t(i + 2, key)
            if v <= 0:
                raise ValueError("Pinned reserve segment size has to be greater than 0")
            vals[key] = v
            i += 2
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            tk.expect(i + 1, ":", key)
            v = min(tk.size_t(i + 2, key), SIZE_MAX // MB) * MB
            vals[key[:-3]] = v
            i += 2
        else:
            # CAC.cpp:125-131: TORCH_CHECK_VALUE(keys.find(key) != keys.end(), "Unrecognized key ...")
            raise ValueError(f"Unrecognized key {key!r} in CUDA allocator config; valid keys are: "
                             + ", ".join(VALID_KEYS))
        # AC.cpp:326-328 / CAC.cpp:137-139: entries are separated by ','
        if i + 1 < n:
            tk.expect(i + 1, ",", key)
            i += 1
        i += 1
    vals["roundup_power2_divisions"] = tuple(divisions)
    return AllocatorConfig(source=env, **vals)


def _parse_roundup(tk: _Tok, i: int, div: list) -> int:
    """AC.cpp:161-226 parseRoundUpPower2Divisions (checked against torch 2.13's libc10.so:
    '[64:8,256:4,1024:4,>:1]' -> 8,8,8,8,8,8,8,0,4,0,4,1,1,1,1,1)."""
    key = "roundup_power2_divisions"
    tk.expect(i + 1, ":", key)
    i += 2
    if tk.get(i, f"a value for {key!r}") == "[":
        first, last_index = True, 0
        while True:
            i += 1
            bound = tk.get(i, "an interval or ']'")
            if bound == "]":
                break
            tk.expect(i + 1, ":", key)
            v = tk.size_t(i + 2, key)
            i += 2
            if not (v == 0 or _is_pow2(v)):              # AC.cpp:174-176
                raise ValueError("For roundups, the divisions has to be power of 2 or 0 to disable roundup, "
                                 f"got {v}")
            if bound == ">":                             # AC.cpp:178-184 fill from last_index + 1
                for j in range(last_index + 1, 16):
                    div[j] = v
            else:
                if not bound.isdigit() or not _is_pow2(int(bound)):   # AC.cpp:186-190
                    raise ValueError(f"For roundups, the intervals have to be power of 2, got {bound!r}")
                index = min(max(int(bound).bit_length() - 1, 0), 15)  # AC.cpp:192-194
                if first:                                # AC.cpp:196-203
                    for j in range(index):
                        div[j] = v
                    first = False
                div[index] = v
                last_index = index
            nxt = tk.get(i + 1, "',' or ']'")
            if nxt != "]":
                tk.expect(i + 1, ",", key)
                i += 1
        return i
    v = tk.size_t(i, key)                                # AC.cpp:216-225 backwards-compatible form
    if not _is_pow2(v):
        raise ValueError(f"For roundups, the divisions has to be power of 2, got {v}")
    for j in range(16):
        div[j] = v
    return i


# ============================================================================================
# Size rules
# ============================================================================================

def _divisions_for(size: int, div: tuple) -> int:
    # AC.cpp:73-87 roundup_power2_divisions(size): interval index = log2(size) - 20, clamped 0..15
    idx = size.bit_length() - 1 - 20
    if idx < 0:
        idx = 0
    elif idx > 15:
        idx = 15
    return div[idx]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """CCA:2565-2583: round up to the next of `divisions` equal steps between powers of two."""
    if size & (size - 1) == 0:                           # CCA:2566 isPowerOf2_64(size)
        return size
    if divisions < 2:                                    # CCA:2570
        raise ValueError("Only 2 or more divisions are supported")
    floor2 = 1 << (size.bit_length() - 1)                # CCA:2574 PowerOf2Floor
    step = floor2 >> (divisions.bit_length() - 1)        # CCA:2575-2576 >> (63 - clz(divisions))
    if step == 0:                                        # CCA:2577-2578
        return floor2 << 1
    rfloor = size & ~(step - 1)                          # CCA:2580
    return size if rfloor == size else rfloor + step     # CCA:2581-2582


def round_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """CCA:2585-2597 round_size."""
    if size < kMinBlockSize:                             # CCA:2586-2587
        return kMinBlockSize
    divisions = _divisions_for(size, config.roundup_power2_divisions)
    if divisions > 1 and size > kMinBlockSize * divisions:   # CCA:2591
        return roundup_power2_next_division(size, divisions)
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)   # CCA:2594


def get_allocation_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """CCA:3115-3123: size of a new segment for a (rounded) request."""
    if size <= kSmallSize:                               # CCA:3116-3117
        return kSmallBuffer
    if size < kMinLargeAlloc:                            # CCA:3118-3119
        return config.large_segment_size
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)   # CCA:3121


