"""SGLang's own KV-event classes (sglang.srt.disaggregation.kv_events, 0.5.23) encode what kvtier's
daemon ingests (issue 16): the decoder reads SGLang's messages as it reads vLLM's."""

from __future__ import annotations

import msgspec
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvtier.core.engine_events import Cleared, Removed, Stored, decode_message


def test_kvtier_reads_sglang_encoded_batches() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    lora_id=None, medium="GPU"),
        BlockRemoved(block_hashes=[12], medium="GPU"),
        AllBlocksCleared(),
    ], attn_dp_rank=0)
    payload = msgspec.msgpack.Encoder().encode(batch)
    seq, events = decode_message([b"kv@node@model", (3).to_bytes(8, "big"), payload])
    assert seq == 3
    assert events == [Stored((11, 12), None, tuple(range(32)), 16, "GPU"), Removed((12,), "GPU"), Cleared()]
