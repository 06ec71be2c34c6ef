"""Packed rows (document mask + restarted positions) compute what separate rows compute."""

from __future__ import annotations

import pytest
import torch

from astrai_core.model.config import ModelConfig
from astrai_core.model.transformer import Transformer, document_mask

SHAPE = {"vocab_size": 61, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}
VARIANTS = {"gqa": {}, "qk_norm": {"qk_norm": True}, "mla": {"attention": "mla", "mla_kv_rank": 16, "mla_rope_dim": 8}}


def model_for(variant: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**SHAPE, **VARIANTS[variant])).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_documents_do_not_see_each_other(variant):
    model = model_for(variant)
    docs = [torch.randint(0, 61, (n,)) for n in (7, 11, 5)]
    row = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(row, positions=positions, mask=document_mask(doc_ids))[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
        leaky = model(row)[0]  # plain causal attention over the whole row: documents 2 and 3 see earlier ones
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert (leaky[7:] - alone[7:]).abs().max() > 1e-3
