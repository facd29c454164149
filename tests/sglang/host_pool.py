"""A host KV pool with SGLang 0.5.23's MHA page addressing, for the zero-copy calls.

SGLang's own host pools (sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost) cannot be
imported in a torch 2.13.0+cpu venv: their package imports the model configs, which import
torchvision, and no torchvision build runs on that torch. The backend uses only these members
of a host pool: `page_size`, `layout`, `size_per_token`, `get_data_page(index, flat)`,
`get_dummy_flat_data_page()` and `set_from_flat_data_page(index, page)`. They are copied here from
MHATokenToKVPoolHost for the page_first and layer_first layouts, same buffer shapes, same slices.
"""

from __future__ import annotations

import torch


class MHAHostPool:
    def __init__(self, size: int, page_size: int, layers: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, layout: str = "page_first") -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layers
        self.head_num, self.head_dim, self.dtype, self.layout = heads, head_dim, dtype, layout
        self.size_per_token = head_dim * heads * layers * dtype.itemsize * 2
        shape = (2, size, layers, heads, head_dim) if layout == "page_first" else (2, layers, size, heads, head_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        else:
            page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
