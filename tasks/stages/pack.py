"""Pack stage: corpus splits + tokenizer -> data/packed/{train,validation,test}.h5 + stats.json.

Each document becomes its token ids followed by <|end_of_text|>, appended end to end (see astrai_core/data/packed.py for
the file format). Text is read line by line and encoded in batches of at most `batch_documents` documents and
`batch_characters` characters; a longer document is encoded in pieces of at most `batch_characters`, cut before a
space, where the tokenizer splits anyway (astrai_core.tokenizer.bpe.piece_bounds), so its tokens are those of the whole
and stream into the file one chunk at a time. Memory is then the budget's plus the longest document's text, not
the tokenizer's working memory of the whole document (gigabytes for 50 MB of text).

Run alone: `astrai stage pack` (what dvc.yaml runs; paths in tasks/run/table.py), or call the
function above from Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from astrai_core.data.packed import PackedWriter
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from astrai_core.runtime.progress import expect
from astrai_core.tokenizer.bpe import load_tokenizer, piece_bounds, specials
from tasks.run.schema import PackParams
from tasks.stages.corpus import SPLITS
from tasks.stages.tokenizer import corpus_documents, iter_texts


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
    eos = specials(tok, tokenizer_path).eos  # a model's own end of text, or astrai's
    attrs = dict(
        vocab_size=tok.get_vocab_size(),
        tokenizer_sha256=sha256_file(tokenizer_path),
        source_manifest_sha256=sha256_file(manifest),
    )

    stats = {}
    with atomic_path(out_dir, "stage pack") as tmp:
        tmp.mkdir()
        for split in SPLITS:
            st = stats[split] = {"documents": 0, "tokens": 0, "characters": 0}
            expect(corpus_documents(corpus_dir, split), f"{split} documents")
            with PackedWriter(tmp / f"{split}.h5", split=split, **attrs) as writer:
                texts = iter_texts(corpus_dir / f"{split}.jsonl")
                for batch in _batches(texts, params.batch_documents, params.batch_characters):
                    for (piece, ends), enc in zip(batch, tok.encode_batch_fast([p for p, _ in batch],
                                                                                add_special_tokens=False)):
                        st["characters"] += len(piece)
                        if ends:
                            writer.add_document(enc.ids + [eos])
                            st["documents"] += 1
                        else:
                            writer.add_tokens(enc.ids)
                st["tokens"] = writer.n_tokens
        write_json(tmp / "stats.json", stats)
    return stats


def _batches(texts: Iterable[str], max_pieces: int, max_chars: int) -> Iterator[list[tuple[str, bool]]]:
    """(piece, ends its document) pairs, at most max_pieces and max_chars characters per batch: whole documents,
    and pieces of those longer than max_chars."""
    batch, size = [], 0
    for text in texts:
        bounds = piece_bounds(text, max_chars)
        for a, b in zip(bounds, bounds[1:]):
            if batch and (len(batch) == max_pieces or size + b - a > max_chars):
                yield batch
                batch, size = [], 0
            batch.append((text[a:b], b == len(text)))  # a whole document's slice is the string itself, no copy
            size += b - a
    if batch:
        yield batch
