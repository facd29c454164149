"""Copies between SGLang's host pages and kvtier blocks. numpy and torch only: no SGLang, no I/O.

A kvtier block holds one SGLang page as the bytes SGLang's generic path moves: the flat page of
`host_pool.get_data_page(index)` (for the MHA page_first layout, K of every token and layer,
then V). The zero-copy path reads and writes the same bytes in place, through the host pool's
own page view (`get_data_page(index, flat=False)`, a view into its kv_buffer), so the two paths
are interchangeable and never disagree on a page's bytes. A page is verified where it landed:
xxh3 over the view's contiguous runs, in order, equals xxh3 over the flat bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.client import checksum_parts, checksum_stream, copy_streamed
from kvtier.integrations.sglang.hicache_config import ConfigError

U8 = npt.NDArray[np.uint8]


def tensor_bytes(t: torch.Tensor) -> U8:
    """A CPU tensor's bytes as a uint8 array sharing its memory (any dtype, bf16 included; the
    last dim must be dense). ValueError if it cannot be viewed so."""
    if t.device.type != "cpu":
        raise ValueError(f"SGLang host pages are CPU tensors, got one on {t.device}")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError("a page whose innermost dimension is strided cannot be viewed as bytes")
    try:
        return t.view(torch.uint8).numpy()
    except RuntimeError as e:
        raise ValueError(f"cannot view the page as bytes: {e}") from e


def flat_bytes(t: torch.Tensor) -> U8:
    """A value SGLang hands to set(): its bytes in order (a copy only if it is not contiguous)."""
    return tensor_bytes(t.detach().cpu().contiguous().reshape(-1))


def runs(a: U8) -> list[U8]:
    """`a` split into C-contiguous pieces, in index order (one piece when `a` is contiguous)."""
    if a.flags.c_contiguous:
        return [a.reshape(-1)]
    lead = 0
    while lead < a.ndim and not a[(0,) * (lead + 1)].flags.c_contiguous:
        lead += 1
    lead += 1  # a[i0, .., i_lead-1] is contiguous for every index
    return [a[idx].reshape(-1) for idx in np.ndindex(*a.shape[:lead])]


def digest(a: U8) -> int:
    """xxh3-64 of the bytes of `a` in index order, without gathering them."""
    return checksum_parts(runs(a))


def copy_in(dst: U8, src: U8) -> int:
    """Block bytes (flat) -> a page view of any strides; the xxh3 of the page as it landed (its
    runs in order, each hashed as it is copied: one pass, equal to `digest(dst)`)."""
    h = checksum_stream()
    off = 0
    for run in runs(dst):
        copy_streamed(h, run, src[off:off + run.size])
        off += run.size
    return h.intdigest()


def copy_out(dst: U8, src: U8) -> int:
    """A page view of any strides -> block bytes (flat: a staging or granted slot); the xxh3 of
    the page's runs as they were copied (hashed from the engine's own memory, never the shared
    slot: kvtier/shm/onepass.py)."""
    h = checksum_stream()
    off = 0
    for run in runs(src):
        copy_streamed(h, dst[off:off + run.size], run, hash_src=True)
        off += run.size
    return h.intdigest()


def page_view(host_pool: Any, index: int) -> U8:
    """The host pool's page starting at token `index`, as bytes in place (ValueError if its
    layout gives no such view)."""
    return tensor_bytes(host_pool.get_data_page(index, flat=False))


def host_page_bytes(host_pool: Any) -> int:
    """Bytes per page of a host pool: what SGLang's generic path moves per page."""
    per_token = getattr(host_pool, "size_per_token", None)
    if isinstance(per_token, int) and per_token > 0:
        return per_token * int(host_pool.page_size)
    page = host_pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


GEOMETRY = ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")


def host_geometry(host_pool: Any) -> dict[str, Any]:
    """What a host pool's page bytes mean, as far as the pool says: dtype and shape attributes."""
    out: dict[str, Any] = {"dtype": str(getattr(host_pool, "dtype", "")).removeprefix("torch.")}
    for name in GEOMETRY:
        v = getattr(host_pool, name, None)
        if isinstance(v, int):
            out[name] = v
    return out


def check_in_place_view(host_pool: Any, page_bytes: int) -> None:
    """interface_v1 reads into SGLang's pages in place: its host layout must give a flat view of
    each page, of the page's bytes. ConfigError (the attach fails) otherwise."""
    try:
        view = page_view(host_pool, 0)
    except Exception as e:
        raise ConfigError(f"SGLang's host layout {getattr(host_pool, 'layout', '?')!r} gives no in-place "
                          f"page view ({e}): leave interface_v1 out of the extra config") from e
    if view.size != page_bytes:
        raise ConfigError(f"SGLang's host page view is {view.size} bytes, its pages {page_bytes}: leave "
                          "interface_v1 out of the extra config")
