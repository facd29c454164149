"""The weights' identity, for every integration's key namespace.

Engines name a model by what the operator typed (vLLM's served name or path, SGLang's model
name). Two deployments that serve different weights under one name (a fine-tune as "llama", a
new revision, another quantization) would share keys and read each other's KV: intact bytes,
checksums pass, silently wrong output. So every namespace carries a `WeightsIdentity`:

- `weights`: what the checkpoint holds, from its files (never the directory's name, so the same
  weights copied elsewhere share keys): per weights file its name, size and, for safetensors,
  the header (names, shapes, dtypes, offsets) plus three windows of every tensor (its first,
  middle and last 4 KiB, small tensors whole). A fine-tune has its base's shapes and headers
  but other values in every tensor it touched, so a window of each tensor tells them apart. Other
  formats (.bin, .pt, .gguf) are read as bytes, never unpickled: 64 windows evenly spaced. No
  file is read whole: a 70B checkpoint costs a few MiB of reads. `weights_id` (operator-given,
  for weights kvtier cannot read) replaces it;
- `config`: a digest of the effective model config (after the engine's overrides: RoPE scaling,
  sliding window, ...), without fields that name a path or a library version;
- `quantization` and `kv_cache_dtype` as the engine resolved them;
- `revision`: the engine's commit hash, when it knows one, for the manifest only (readable):
  the content already decides, so a Hub id and a local copy of the same commit share keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WINDOW = 4096  # bytes hashed at each sample point
FILE_WINDOWS = 64  # sample points of a file whose tensors cannot be listed
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not believed
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack", ".ckpt")
# Config keys that name where or by what the config was written, not what the model computes.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                                  "_attn_implementation", "_attn_implementation_autoset",
                                  "_attn_implementation_internal", "_experts_implementation"})


class WeightsUnknown(ValueError):
    """No identity could be established: the integration refuses rather than share keys by name."""


@dataclass(frozen=True, slots=True)
class WeightsIdentity:
    weights: str  # "content:<hex>" or "operator:<weights_id>"
    config: str  # hex digest of the effective config
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    revision: str | None = None  # readable only: not part of the key

    def key_fields(self) -> dict[str, Any]:
        """What goes into a namespace (the revision does not: the content decides)."""
        return {"weights": self.weights, "config": self.config, "quantization": self.quantization,
                "kv_cache_dtype": self.kv_cache_dtype}

    def readable(self) -> dict[str, Any]:
        return asdict(self)


def config_digest(config: Mapping[str, Any]) -> str:
    """The effective config's digest: canonical JSON (sorted keys, values that JSON lacks as their
    repr), volatile keys dropped at every depth."""
    return hashlib.sha256(json.dumps(_stable(config), sort_keys=True, separators=(",", ":"),
                                     default=repr).encode()).hexdigest()[:32]


def _stable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _stable(v) for k, v in value.items() if str(k) not in VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weights files under `directory` (recursively, sorted by relative path)."""
    found = [p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
             and not any(part.startswith(".") for part in p.relative_to(directory).parts)]
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


@dataclass(frozen=True, slots=True)
class Fingerprint:
    digest: str
    files: int
    bytes_read: int
    seconds: float


def content_fingerprint(directory: str | os.PathLike[str]) -> Fingerprint:
    """The checkpoint's content fingerprint (module docstring). WeightsUnknown when the directory
    holds no weights file."""
    root = Path(directory)
    t0 = time.perf_counter()
    files = weight_files(root) if root.is_dir() else []
    if not files:
        raise WeightsUnknown(f"no weights files ({', '.join(WEIGHT_SUFFIXES)}) under {str(root)!r}")
    h = hashlib.sha256(b"kvtier/weights/v1")
    read = 0
    for path in files:
        name = path.relative_to(root).as_posix().encode()
        size = path.stat().st_size
        h.update(struct.pack("<IQ", len(name), size) + name)
        with open(path, "rb") as f:
            for chunk in _samples(f, size, path.suffix == ".safetensors"):
                read += len(chunk)
                h.update(struct.pack("<I", len(chunk)) + chunk)
    return Fingerprint("content:" + h.hexdigest()[:32], len(files), read, time.perf_counter() - t0)


def _samples(f: Any, size: int, safetensors: bool) -> Iterable[bytes]:
    spans = _tensor_spans(f, size) if safetensors else None
    if spans is None:  # not a safetensors file we can read: evenly spaced windows of the file
        if size <= FILE_WINDOWS * WINDOW:
            f.seek(0)
            yield f.read()
            return
        points = [(size - WINDOW) * i // (FILE_WINDOWS - 1) for i in range(FILE_WINDOWS)]
        for at in points:
            f.seek(at)
            yield f.read(WINDOW)
        return
    header_end, tensors = spans
    f.seek(0)
    yield f.read(header_end)  # the length and the JSON header: names, dtypes, shapes, offsets
    for start, end in tensors:
        for at, n in _windows(start, end):
            f.seek(at)
            yield f.read(n)


def _windows(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of a tensor's first, middle and last window; the whole of a small one."""
    n = end - start
    if n <= 3 * WINDOW:
        return [(start, n)]
    return [(start, WINDOW), (start + (n - WINDOW) // 2, WINDOW), (end - WINDOW, WINDOW)]


def _tensor_spans(f: Any, size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """A safetensors file's header end and each tensor's absolute byte span, sorted; None when the
    bytes are not a well-formed header (then the file is sampled as bytes)."""
    if size < 8:
        return None
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(MAX_HEADER, size - 8):
        return None
    try:
        header = json.loads(f.read(n))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
                or not 0 <= offs[0] <= offs[1] or base + offs[1] > size):
            return None
        spans.append((base + offs[0], base + offs[1]))
    return base, sorted(spans)


def weights_directory(model: str, revision: str | None, download_dir: str | None = None) -> str | None:
    """The local directory of `model`: a path, or a Hub id in the local Hugging Face cache at
    `revision` (a branch, tag or commit; None: main). None when it is neither."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir,
                                     local_files_only=True))
    except Exception:  # noqa: BLE001 - not a Hub id, not cached, no huggingface_hub: unknown
        return None


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's config.json; WeightsUnknown when it cannot be read."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsUnknown(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(config, dict):
        raise WeightsUnknown(f"{str(path)!r} is not a JSON object")
    return config


def identify(*, weights_id: str | None, directory: str | os.PathLike[str] | None, config: Mapping[str, Any],
             quantization: str | None, kv_cache_dtype: str | None, revision: str | None = None,
             log: Callable[[str], None] | None = None) -> WeightsIdentity:
    """The identity an integration puts in its namespace: the operator's `weights_id` when given,
    else the content of `directory`. WeightsUnknown when neither is usable. `log` gets one line
    saying what was read and how long it took."""
    if weights_id is not None:
        if not isinstance(weights_id, str) or not weights_id.strip():
            raise WeightsUnknown("weights_id must be a non-empty string")
        weights = "operator:" + weights_id.strip()
    elif directory is None:
        raise WeightsUnknown("the engine did not say where its weights are; set weights_id (the weights' "
                             "revision or a digest of their content) in kvtier's options")
    else:
        fp = content_fingerprint(directory)
        weights = fp.digest
        if log is not None:
            log(f"weights identity {fp.digest} from {fp.files} files under {directory} "
                f"({fp.bytes_read / (1 << 20):.1f} MiB read in {fp.seconds:.2f} s)")
    return WeightsIdentity(weights=weights, config=config_digest(config),
                           quantization=None if quantization is None else str(quantization),
                           kv_cache_dtype=None if kv_cache_dtype is None else str(kv_cache_dtype),
                           revision=revision)
