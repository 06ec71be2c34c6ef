"""Pack stage: corpus splits + tokenizer -> data/packed/{train,validation,test}.h5 + stats.json.

Each document becomes its token ids followed by <|end_of_text|>, appended end to end (see astrai_core/data.py for
the file format). Text is read line by line and encoded `batch_documents` at a time, so memory stays flat however
large the corpus.

Run alone: `astrai stage pack` (what dvc.yaml runs; paths in tasks/stages.py), or call the
function above from Python.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

from astrai_core.data import PackedWriter
from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path, sha256_file, write_json
from astrai_core.tokenizer import load_tokenizer, special_id
from tasks.corpus import SPLITS
from tasks.params import PackParams
from tasks.tokenizer import iter_texts


def pack(params: PackParams, corpus_dir: Path, tokenizer_path: Path, out_dir: Path) -> dict:
    """Write out_dir/{split}.h5 and out_dir/stats.json (all or nothing); return the stats."""
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    manifest = corpus_dir / "manifest.json"
    for path in [manifest, *(corpus_dir / f"{s}.jsonl" for s in SPLITS)]:
        if not path.is_file():
            raise AstraiError(f"{path}: not found; run the corpus stage first")
    tok = load_tokenizer(tokenizer_path)
    # Corpus text that happens to contain "<|end_of_text|>" is text, not a document boundary: encode it byte by byte.
    tok.encode_special_tokens = True
    eos = special_id(tok, "eos")
    attrs = dict(
        vocab_size=tok.get_vocab_size(),
        tokenizer_sha256=sha256_file(tokenizer_path),
        source_manifest_sha256=sha256_file(manifest),
    )

    stats = {}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for split in SPLITS:
            st = stats[split] = {"documents": 0, "tokens": 0, "characters": 0}
            with PackedWriter(tmp / f"{split}.h5", split=split, **attrs) as writer:
                for texts in _batches(iter_texts(corpus_dir / f"{split}.jsonl"), params.batch_documents):
                    for text, enc in zip(texts, tok.encode_batch_fast(texts, add_special_tokens=False)):
                        writer.add_document(enc.ids + [eos])
                        st["documents"] += 1
                        st["characters"] += len(text)
                st["tokens"] = writer.n_tokens
        write_json(tmp / "stats.json", stats)
    return stats


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """itertools.batched, which needs Python 3.12."""
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch
