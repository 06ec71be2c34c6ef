"""The DPO reference cache: the frozen reference model's summed log-probability of every response, computed once
(the dpo_reference stage) and read by the dpo strategy, so training never holds a reference model.

The file is keyed by the sha256 of the data and of the reference weights; a cache computed for other data or
another reference is refused.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

from astrai_core.data.batches import Documents, pair_batch
from astrai_core.model.losses import sequence_logps
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.device import model_device, uses_bf16
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file
from astrai_core.runtime.progress import advance, expect


@torch.no_grad()
def reference_logps(model: Transformer, data_path: str, tokenizer_sha256: str, batch_size: int = 16,
                    dtype: str = "fp32") -> np.ndarray:
    """Summed log-probability of each document's masked tokens under `model`, on its device: the DPO reference. `dtype` (a
    TrainConfig.dtype) runs the forward under the autocast the DPO run computes its policy's in (log-probabilities
    stay fp32)."""
    docs = Documents(data_path, tokenizer_sha256, model.cfg.vocab_size)
    device = model_device(model)
    out = np.zeros(docs.n_docs, dtype=np.float64)
    model.eval()
    expect(docs.n_docs // 2, "preference pairs")
    for first in range(0, docs.n_docs, 2 * batch_size):
        pairs = np.arange(first // 2, min(first // 2 + batch_size, docs.n_docs // 2))
        b = pair_batch(docs, pairs, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(dtype, device)):
            logits = model(b["x"])
        out[b["docs"].cpu().numpy()] = sequence_logps(logits, b["y"]).double().cpu().numpy()
        advance(len(pairs))
    return out


def save_reference_logps(path: str | Path, logps: np.ndarray, data_path: str | Path, reference_weights: str | Path) -> None:
    with atomic_path(path, "reference log-probabilities") as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("logps", data=logps)
        f.attrs["data_sha256"] = sha256_file(data_path)
        f.attrs["reference_sha256"] = sha256_file(reference_weights)


def load_reference_logps(path: str, data_path: str, reference_weights: Path) -> np.ndarray:
    """The cached log-probabilities, refused unless they were computed on this data with these weights."""
    if not Path(path).is_file():
        raise AstraiError(f"{path}: reference log-probabilities not found; run the dpo_reference stage")
    with h5py.File(path, "r") as f:
        for key, file in (("data_sha256", data_path), ("reference_sha256", reference_weights)):
            if f.attrs.get(key) != sha256_file(file):
                raise AstraiError(f"{path}: computed for another {file} ({key} differs); re-run the dpo_reference stage")
        return f["logps"][:]
