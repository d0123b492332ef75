"""Training data: local files in, tokenized examples, packed fixed-shape batches out."""

from jaxtune.data.formats import FORMATS, check_rows, encode_rows
from jaxtune.data.packing import PackedRows, pack_examples
from jaxtune.data.sources import read_rows
from jaxtune.data.stream import BatchStream

__all__ = ["FORMATS", "BatchStream", "PackedRows", "check_rows", "encode_rows", "pack_examples", "read_rows"]
