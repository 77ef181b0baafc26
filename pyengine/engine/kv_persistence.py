"""KV cache persistence: the reusable prefix-cache blocks to a file and back
(docs/kv_persistence.md has the format and the rules).

File layout (little endian):
    header   MAGIC (8 bytes), format version (u32), JSON length (u32), JSON (fingerprint and
             layout), crc32 of the JSON (u32)
    records  per block: key (u64), parent key (u64), tokens (i32 x tokens_per_block), the
             block's K/V bytes (pool dtype, [layer, k/v, kv head, token, head dim]; with a
             draft model, the draft pool's block follows the target's), crc32 of all of the
             record before it (u32); most recently used first
    trailer  END_MAGIC (8 bytes), record count (u64): a file cut at a record boundary is
             still caught

Saving streams one block at a time into `path + ".tmp"`, fsyncs it, renames it over `path`
and fsyncs the directory: a crash leaves the previous file whole. Loading reads the file
twice: the first pass checks everything (header, fingerprint, every checksum, the trailer)
without touching the pool; only then are the blocks registered and their K/V copied in.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pyengine.core import CoreBatchManager

MAGIC = b"PYEKVC\x00\x01"
END_MAGIC = b"PYEKVEND"
FORMAT_VERSION = 1
# How block keys are chained (csrc/kv_cache/kv_cache_manager.cpp): a change there must change this.
SALT_SCHEME = "splitmix64-chain-v1"
_HEAD = struct.Struct("<8sII")
_U32 = struct.Struct("<I")
_KEYS = struct.Struct("<QQ")
_TRAILER = struct.Struct("<8sQ")
_SAMPLE = 1 << 16  # bytes hashed at each end of a model file


class KvCacheFileError(ValueError):
    """A KV cache file that cannot be loaded into this engine; the pool is unchanged."""

    __module__ = "pyengine"

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        super().__init__(f"KV cache file {os.fspath(path)}: {what}")
        self.path = os.fspath(path)


def _file_identity(path: Path) -> str:
    """Size and a hash of the first and last 64 KiB: cheap on a large checkpoint, and a
    different checkpoint (header, shapes or trained values) differs in one of them."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > _SAMPLE:
            f.seek(max(_SAMPLE, size - _SAMPLE))
            h.update(f.read())
    return f"{size}:{h.hexdigest()[:32]}"


def model_identity(model: str | os.PathLike) -> dict[str, str]:
    """Per model file (config, weights, GGUF file): its identity. Tokenizer files are left out:
    they do not change the KV of a token id."""
    p = Path(model)
    if p.is_file():
        return {p.name: _file_identity(p)}
    files = sorted(f for f in p.iterdir()
                   if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".gguf")))
    return {f.name: _file_identity(f) for f in files}


def fingerprint(config: Any, kv_dtype: torch.dtype, pools: list[torch.Tensor]) -> dict[str, Any]:
    """What must match for a saved block's K/V to be what this engine would compute. `pools`:
    the target's KV pool, then the draft model's when speculative decoding has one (its
    blocks share the target's ids, so a record carries both)."""
    kc = config.kv_cache_config
    draft = None
    if len(pools) > 1:
        spec = config.speculative_config
        draft = {"model_files": model_identity(spec.draft_model), "quantization": spec.draft_quantization,
                 "block_shape": list(_block_shape(pools[1]))}
    # "draft" is None without a draft model, as in files written before it was recorded
    return {"model_files": model_identity(config.model), "dtype": str(config.dtype).removeprefix("torch."),
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "tokens_per_block": kc.tokens_per_block,
            "salt_scheme": SALT_SCHEME, "kv_scales": [kc.k_scale, kc.v_scale],
            "quantization": config.quantization, "quantize_lm_head": _float_embeddings(config),
            # (where the model ties them, the output projection's format is the embedding table's:
            # other hidden states; recorded whether tied or not)
            "lm_head_quantization": config.lm_head_quantization,
            "exact_fp32": config.exact_fp32, "block_shape": list(_block_shape(pools[0])), "draft": draft}


def _float_embeddings(config: Any) -> bool | None:
    """False where a quantized model keeps its embedding table in float (quantize_lm_head=False):
    its hidden states, and so its K/V, differ from those of the default's quantized table. None
    otherwise (no quantization, or the default), as in files written before it was recorded."""
    return False if config.quantization is not None and not config.quantize_lm_head else None


def _block_shape(pool: torch.Tensor) -> tuple[int, ...]:
    layers, kv, _, heads, tpb, dim = pool.shape
    return (layers, kv, heads, tpb, dim)


def _block_bytes(pools: list[torch.Tensor]) -> list[int]:
    """Bytes of one block in each pool."""
    return [pool[:, :, 0].numel() * pool.element_size() for pool in pools]


def _check_idle(bm: CoreBatchManager, busy: bool, what: str) -> None:
    if busy or bm.has_unfinished():
        raise RuntimeError(f"{what} needs an idle engine: {bm.num_requests} requests are in flight "
                           "(finish or abort them first)")


def save(path: str | os.PathLike, bm: CoreBatchManager, pools: list[torch.Tensor], fp: dict[str, Any],
         busy: bool = False) -> dict[str, Any]:
    """Writes the reusable blocks to `path` atomically. Returns blocks, bytes, seconds."""
    _check_idle(bm, busy, "save_kv_cache")
    start = time.perf_counter()
    records = bm.export_cached_blocks()
    path = os.fspath(path)
    tmp = path + ".tmp"
    header = json.dumps({"fingerprint": fp, "num_records": len(records), "block_bytes": sum(_block_bytes(pools))},
                        sort_keys=True).encode()
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, FORMAT_VERSION, len(header)))
            f.write(header)
            f.write(_U32.pack(zlib.crc32(header)))
            for block, key, parent, tokens in records:
                _write_record(f, key, parent, tokens, [pool[:, :, block] for pool in pools])
            f.write(_TRAILER.pack(END_MAGIC, len(records)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return {"blocks": len(records), "bytes": os.path.getsize(path), "seconds": time.perf_counter() - start}


def _write_record(f: BinaryIO, key: int, parent: int, tokens: list[int], blocks: list[torch.Tensor]) -> None:
    meta = _KEYS.pack(key, parent) + struct.pack(f"<{len(tokens)}i", *tokens)
    f.write(meta)
    crc = zlib.crc32(meta)
    for block in blocks:
        # one block at a time through host memory: saving never holds more than a block's copy
        data = block.contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
        f.write(data)
        crc = zlib.crc32(data, crc)
    f.write(_U32.pack(crc))


def _unlink_quietly(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_exact(f: BinaryIO, n: int, path: str, what: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise KvCacheFileError(path, f"truncated in {what} (wanted {n} bytes, got {len(b)})")
    return b


def _read_header(f: BinaryIO, path: str, fp: dict[str, Any], block_bytes: int) -> int:
    magic, version, n = _HEAD.unpack(_read_exact(f, _HEAD.size, path, "the header"))
    if magic != MAGIC:
        raise KvCacheFileError(path, "not a pyengine KV cache file (bad magic)")
    if version != FORMAT_VERSION:
        raise KvCacheFileError(path, f"format version {version}; this pyengine reads version {FORMAT_VERSION}")
    raw = _read_exact(f, n, path, "the header")
    (crc,) = _U32.unpack(_read_exact(f, 4, path, "the header"))
    if zlib.crc32(raw) != crc:
        raise KvCacheFileError(path, "header checksum mismatch (corrupt file)")
    header = json.loads(raw)
    # the layout last: a dtype or tokens_per_block difference is named as such
    for field in sorted(set(fp) | set(header["fingerprint"]), key=lambda k: (k == "block_shape", k)):
        got, expected = header["fingerprint"].get(field), fp.get(field)
        if got != expected:
            raise KvCacheFileError(path, f"fingerprint mismatch in '{field}': the file has {got!r}, "
                                         f"this engine has {expected!r}")
    if header["block_bytes"] != block_bytes:  # implied by the fingerprint; checked for the reader's sake
        raise KvCacheFileError(path, f"block size {header['block_bytes']} bytes, the pool's is {block_bytes}")
    return int(header["num_records"])


def _scan(f: BinaryIO, path: str, fp: dict[str, Any], tpb: int,
          block_bytes: int) -> list[tuple[int, int, list[int], int]]:
    """The first pass: every check, no pool access. Returns (key, parent, tokens, data offset)."""
    n = _read_header(f, path, fp, block_bytes)
    meta_size = _KEYS.size + 4 * tpb
    buf = bytearray(block_bytes)
    records = []
    for i in range(n):
        meta = _read_exact(f, meta_size, path, f"record {i} of {n}")
        offset = f.tell()
        got = f.readinto(buf)
        if got != block_bytes:
            raise KvCacheFileError(path, f"truncated in record {i} of {n} (wanted {block_bytes} bytes, got {got})")
        (crc,) = _U32.unpack(_read_exact(f, 4, path, f"record {i} of {n}"))
        if zlib.crc32(buf, zlib.crc32(meta)) != crc:
            raise KvCacheFileError(path, f"checksum mismatch in record {i} of {n} (corrupt file)")
        key, parent = _KEYS.unpack_from(meta)
        records.append((key, parent, list(struct.unpack_from(f"<{tpb}i", meta, _KEYS.size)), offset))
    magic, count = _TRAILER.unpack(_read_exact(f, _TRAILER.size, path, "the trailer"))
    if magic != END_MAGIC or count != n:
        raise KvCacheFileError(path, "bad trailer (corrupt file)")
    if f.read(1):
        raise KvCacheFileError(path, "trailing bytes after the trailer (corrupt file)")
    return records


def load(path: str | os.PathLike, bm: CoreBatchManager, pools: list[torch.Tensor], fp: dict[str, Any],
         busy: bool = False) -> dict[str, Any]:
    """Checks the file, then puts its blocks into the pool as reusable cached blocks, most
    recent first, as many as fit. Raises KvCacheFileError (pool unchanged) for a file that
    does not match or is damaged. Returns blocks_loaded, blocks_skipped, bytes, seconds."""
    _check_idle(bm, busy, "load_kv_cache")
    start = time.perf_counter()
    path = os.fspath(path)
    sizes = _block_bytes(pools)
    block_bytes = sum(sizes)
    with open(path, "rb") as f:
        records = _scan(f, path, fp, pools[0].shape[4], block_bytes)
        try:
            got = bm.import_cached_blocks([(k, p, t) for k, p, t, _ in records])
        except ValueError as e:  # keys that do not chain: checksummed, so written that way
            raise KvCacheFileError(path, str(e)) from e
        buf = bytearray(block_bytes)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        hosts, at = [], 0  # each pool's part of a record, viewed in place
        for pool, size in zip(pools, sizes):
            hosts.append(raw[at:at + size].view(pool.dtype).view(_block_shape(pool)))
            at += size
        loaded = 0
        for (_, _, _, offset), block in zip(records, got):
            if block < 0:
                continue
            f.seek(offset)
            f.readinto(buf)
            for pool, host in zip(pools, hosts):
                pool[:, :, block].copy_(host)
            loaded += 1
    if pools[0].device.type == "cuda":
        torch.cuda.synchronize(pools[0].device)
    return {"blocks_loaded": loaded, "blocks_skipped": len(records) - loaded, "bytes": loaded * block_bytes,
            "seconds": time.perf_counter() - start}
