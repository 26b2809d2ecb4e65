"""The run's events table in Arrow: one fixed schema for every rank, the compressed per-rank
tables a load keeps (cache files, worker -> parent), and the one-time assembly of the run's
frame from them (:func:`frame_from_tables`). The schema itself is :mod:`pptrace.ingest.schema`.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import zlib

import numpy as np
import pandas as pd

from .schema import BOOL_COLUMNS, CATEGORY_COLUMNS, COLUMNS, INT32_COLUMNS, INT_COLUMNS, NULLABLE_INT_COLUMNS, nullable_int

#: columns of 32-bit ints: the non-nullable rank and step, and the nullable INT32_COLUMNS
_INT32 = ("rank", "step", *INT32_COLUMNS)


@functools.cache  # immutable: built once, not per rank's table
def arrow_schema():
    import pyarrow as pa

    fields = []
    for column in COLUMNS:
        if column in CATEGORY_COLUMNS:
            kind = pa.dictionary(pa.int32(), pa.string())
        elif column in BOOL_COLUMNS:
            kind = pa.bool_()
        elif column in _INT32:
            kind = pa.int32()
        else:
            kind = pa.int64()
        fields.append(pa.field(column, kind))
    return pa.schema(fields)


def to_arrow(df: pd.DataFrame):
    import pyarrow as pa

    schema = arrow_schema()
    arrays = []
    for field in schema:
        col = df[field.name]
        if field.name in CATEGORY_COLUMNS:
            cat = col.astype("category").cat
            codes = cat.codes.to_numpy().astype(np.int32)
            values = pa.array([str(v) for v in cat.categories], type=pa.string())
            arrays.append(pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), values))
        elif field.name in NULLABLE_INT_COLUMNS:
            array = col.array  # build_frame's tables have the schema's dtypes already
            if array.dtype != (pd.Int32Dtype() if field.name in INT32_COLUMNS else pd.Int64Dtype()):
                array = nullable_int(field.name, col.to_numpy(dtype=np.int64, na_value=0), col.isna().to_numpy())
            arrays.append(pa.array(array, type=field.type))
        else:
            arrays.append(pa.array(col.to_numpy(), type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def from_arrow(table) -> pd.DataFrame:
    """Arrow table(s) in :func:`arrow_schema` -> DataFrame with the documented dtypes."""
    import pyarrow as pa

    if table.num_rows == 0:
        return empty_frame()
    table = table.unify_dictionaries()
    # self_destruct frees each Arrow column once converted: the peak holds one copy, not two.
    df = table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype()}.get,
                         self_destruct=True, split_blocks=True)
    del table
    for column in INT_COLUMNS:
        df[column] = df[column].to_numpy(dtype=np.int64)
    for column in ("rank", "step"):
        df[column] = df[column].to_numpy(dtype=np.int32)
    return df


def empty_frame() -> pd.DataFrame:
    data = {}
    for column in COLUMNS:
        if column in CATEGORY_COLUMNS:
            data[column] = pd.Categorical([])
        elif column in NULLABLE_INT_COLUMNS:
            data[column] = nullable_int(column, np.zeros(0, np.int64), np.zeros(0, bool))
        elif column in BOOL_COLUMNS:
            data[column] = np.zeros(0, dtype=bool)
        elif column in ("rank", "step"):
            data[column] = np.zeros(0, dtype=np.int32)
        else:
            data[column] = np.zeros(0, dtype=np.int64)
    return pd.DataFrame(data)


#: Schema metadata key of a stored table's checksums, "<metadata digest>:<table digest>": of
#: its other metadata, and of that and every message after the schema (headers and bodies),
#: so that a file damaged on disk is never read as data (lz4/zstd frames carry no checksum, small
#: buffers are stored uncompressed, and a message header holds the lengths). CRC-32s, or with
#: a ``key`` (store.py's per-user secret) HMAC-SHA256s: a CRC finds damage, but anyone
#: who can write the file can recompute it over data of their own; a keyed digest they cannot.
CHECKSUM_KEY = b"pptrace.crc32"
_FILE_MAGIC_BYTES = 8  # "ARROW1" and its padding, before the IPC stream


class _Crc:
    """zlib.crc32 behind hashlib's update / hexdigest."""

    def __init__(self, data: bytes = b"", value: int = 0):
        self.value = zlib.crc32(data, value)

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return str(self.value)


def _hasher(data: bytes, key: bytes | None):
    # HMAC-SHA256: 3x keyed BLAKE2b's speed where the CPU has SHA instructions (750 vs 260 MB/s here)
    return _Crc(data) if key is None else hmac.new(key, data, hashlib.sha256)


def _metadata_digest(metadata: dict, key: bytes | None = None) -> str:
    return _hasher(b"\0".join(k + b"=" + v for k, v in sorted(metadata.items()) if k != CHECKSUM_KEY),
                   key).hexdigest()


def _checksums(stream, metadata: dict, key: bytes | None = None) -> bytes:
    """CHECKSUM_KEY's value for the IPC ``stream`` (a file's bytes after the magic) of a
    table with schema ``metadata``. The schema message itself is left out (it holds this
    value); read() compares the schema it declares with :func:`arrow_schema` instead."""
    import pyarrow as pa

    first = _metadata_digest(metadata, key)
    # the table's digest goes on from the metadata's (a CRC from its value)
    digest = _Crc(value=int(first)) if key is None else _hasher(first.encode(), key)
    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(stream))
    while True:  # a few messages: the schema, the dictionaries, the record batches
        try:
            message = reader.read_next_message()
        except StopIteration:
            break
        if message is None:
            break
        if message.type != "schema":
            digest.update(message.metadata)
            if message.body is not None:
                digest.update(message.body)
    return f"{first}:{digest.hexdigest()}".encode()


def metadata_intact(metadata: dict, key: bytes | None = None) -> bool:
    """Whether a stored table's schema metadata (its footer's, as read without the data)
    is as written (with ``key``: by the holder of that key); False for a table stored
    without checksums."""
    value = (metadata or {}).get(CHECKSUM_KEY, b"")
    return hmac.compare_digest(value.split(b":")[0], _metadata_digest(metadata, key).encode())


def _codec() -> str | None:
    """The compression of stored tables: LZ4 inflates ~2.6x faster than zstd (1.6 against
    4.2 ms a rank on bench_analyze's 1,024-rank run, which spent 1.9 s of a cached analysis
    inflating its tables) for ~1.8x the bytes (172 against 97 KB a rank, about its .json.gz).
    A cached load is what users repeat; the cache is a few percent of the JSON. Entries of
    either codec read the same (Arrow IPC names its codec)."""
    import pyarrow as pa

    return next((c for c in ("lz4", "zstd") if pa.Codec.is_available(c)), None)


class StoredTable:
    """A per-rank table kept compact until the run's frame is assembled: an Arrow IPC file
    (its cache entry) or the same bytes in memory, buffers compressed (_codec), read back once
    by :func:`frame_from_tables`. ``num_rows`` is known without reading the data.
    ``source``: (trace path, rank) a cache entry was parsed from, to parse it again should
    the entry turn out broken. Picklable (worker -> parent)."""

    __slots__ = ("num_rows", "path", "ipc", "source")

    def __init__(self, num_rows: int, path=None, ipc: bytes | None = None, source: tuple | None = None):
        self.num_rows, self.path, self.ipc, self.source = int(num_rows), path, ipc, source

    @staticmethod
    def write_ipc(table, sink) -> None:
        import pyarrow as pa

        options = pa.ipc.IpcWriteOptions(compression=_codec())
        with pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table)

    @classmethod
    def write_checked(cls, table, path, key: bytes | None = None) -> None:
        """An IPC file of ``table`` with its checksum (CHECKSUM_KEY; keyed with ``key``) in the
        schema metadata, which :meth:`read` verifies. Serialized twice: the checksum covers the
        bodies of the first, which the metadata does not change."""
        import pyarrow as pa

        first = pa.BufferOutputStream()
        cls.write_ipc(table, first)
        metadata = dict(table.schema.metadata or {})
        metadata[CHECKSUM_KEY] = _checksums(first.getvalue().slice(_FILE_MAGIC_BYTES), metadata, key)
        del first
        cls.write_ipc(table.replace_schema_metadata(metadata), path)

    @classmethod
    def pack(cls, table) -> "StoredTable":
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        cls.write_ipc(table, sink)
        return cls(table.num_rows, ipc=sink.getvalue().to_pybytes())

    def read(self, key: bytes | None = None):
        """The table, in memory from the system allocator: freed memory goes back to the
        OS instead of staying in Arrow's pool while the run's frame lives on. A file's
        checksums are verified (with ``key``: they must be that key's digests)."""
        import pyarrow as pa

        pool = pa.system_memory_pool()
        # one thread: a rank's table is a few MB, and handing each column's buffers to Arrow's
        # pool of threads cost more than it gained (0.45 against 1.5 ms a rank on 2 cores,
        # a third of it in futex calls: 1.1 s of a cached 1,024-rank load)
        options = pa.ipc.IpcReadOptions(use_threads=False)
        if self.path is not None:
            with pa.OSFile(str(self.path)) as source:
                stream = source.read_buffer().slice(_FILE_MAGIC_BYTES)
            # the messages in order, as checksummed (the footer only indexes them)
            reader = pa.ipc.open_stream(stream, memory_pool=pool, options=options)
            metadata = reader.schema.metadata or {}
            if (key is not None or CHECKSUM_KEY in metadata) and (
                    not hmac.compare_digest(metadata.get(CHECKSUM_KEY, b""), _checksums(stream, metadata, key))
                    or not reader.schema.remove_metadata().equals(arrow_schema())):
                raise ValueError(f"{self.path}: checksum mismatch (damaged on disk?)")
            return reader.read_all()
        return pa.ipc.open_file(pa.py_buffer(self.ipc), memory_pool=pool, options=options).read_all()


def frame_from_tables(tables: list, reparse=None, key: bytes | None = None) -> pd.DataFrame:
    """Many per-rank tables (pyarrow Tables or :class:`StoredTable`) -> one DataFrame.

    The result's columns are allocated once and filled table by table; a stored table is
    read only when its turn comes and dropped right after, and ``tables`` is emptied as it
    goes: the peak is the result plus one rank's table, never every rank's tables at once.
    ``reparse(item)``: the table of a broken cache entry, parsed again from its trace (the
    loader's, load.parse_again: parsing sits above this layer); None: a broken entry raises.
    ``key``: the secret the cache entries' digests are keyed with (StoredTable.read).
    """
    n = sum(t.num_rows for t in tables)
    if n == 0:
        tables.clear()
        return empty_frame()
    schema = arrow_schema()
    out: dict = {}
    lookups: dict = {}
    for field in schema:
        name = field.name
        if name in CATEGORY_COLUMNS:
            # the narrowest codes pandas would use; widened if the categories outgrow them
            out[name], lookups[name] = np.empty(n, dtype=np.int8), {}
        elif name in NULLABLE_INT_COLUMNS:
            # np.zeros: the pages of all-null stretches are never written, so never resident
            out[name] = (np.zeros(n, dtype=np.int32 if name in INT32_COLUMNS else np.int64), np.empty(n, dtype=bool))
        else:
            out[name] = np.empty(n, dtype=np.bool_ if name in BOOL_COLUMNS else (np.int32 if name in _INT32 else np.int64))
    pos = 0
    tables.reverse()
    while tables:
        item = tables.pop()
        table = _read_stored(item, reparse, key) if isinstance(item, StoredTable) else item
        del item
        _fill(out, lookups, table, pos)
        pos += table.num_rows
        del table
    columns: dict = {}
    for field in schema:
        name = field.name
        if name in CATEGORY_COLUMNS:
            codes = out.pop(name)
            categories = pd.Index(list(lookups[name]), dtype=object)
            columns[name] = pd.Categorical.from_codes(codes, categories=categories)
            del codes
        elif name in NULLABLE_INT_COLUMNS:
            columns[name] = pd.arrays.IntegerArray(*out.pop(name))
        else:
            columns[name] = out.pop(name)
    return pd.DataFrame(columns, copy=False)


def _read_stored(item: StoredTable, reparse, key: bytes | None = None):
    """The table of ``item``; a broken cache entry (damaged on disk, or replaced by another
    pptrace since it was looked up) is parsed again by ``reparse``."""
    import pyarrow as pa

    from ..errors import TraceError

    try:
        table = item.read(key)
        # full: bad dictionary indices or offsets would otherwise fail (or read out of
        # bounds) when the columns are copied; a file whose keyed digests read() verified
        # holds what this user's pptrace wrote: to_arrow's tables, valid as built
        if item.path is None or key is None:
            table.validate(full=True)
    except (OSError, ValueError, pa.ArrowException) as exc:
        problem = f"unreadable ({' '.join(str(exc).split())[:200]})"
    else:
        if table.num_rows == item.num_rows:
            return table
        problem = f"{table.num_rows} rows where {item.num_rows} were recorded"
    if reparse is not None and item.path is not None and item.source is not None:
        return reparse(item)
    where = item.path if item.path is not None else "a rank's table in memory"
    raise TraceError(f"{where}: {problem}; delete the cache entry and load again")


def _fill(out: dict, lookups: dict, table, pos: int) -> None:
    """Copy one table's columns into the preallocated result at row ``pos``."""
    import pyarrow as pa

    size = table.num_rows
    rows = slice(pos, pos + size)
    present = set(table.column_names)
    for name in out:
        # (every table has the one schema; a column it lacks would be all null)
        col = table.column(name) if name in present else pa.nulls(size, pa.int64())
        if name in CATEGORY_COLUMNS:
            if col.null_count == size:
                out[name][rows] = -1
                continue
            chunk = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
            if not pa.types.is_dictionary(chunk.type):
                chunk = chunk.dictionary_encode()
            lookup = lookups[name]
            remap = np.array([lookup.setdefault(v, len(lookup)) for v in chunk.dictionary.to_pylist()] or [0], dtype=np.int32)
            codes = out[name]
            if len(lookup) > np.iinfo(codes.dtype).max:
                wide = np.int16 if len(lookup) <= np.iinfo(np.int16).max else np.int32
                codes = out[name] = codes.astype(wide)
            if chunk.null_count:
                idx = chunk.indices.fill_null(-1).to_numpy(zero_copy_only=False)
                codes[rows] = np.append(remap, -1)[idx]  # a null's -1 reads the appended -1
            else:
                codes[rows] = remap[chunk.indices.to_numpy(zero_copy_only=False)]
        elif name in NULLABLE_INT_COLUMNS:
            data, mask = out[name]
            if col.null_count == size:
                mask[rows] = True  # data stays 0 (untouched)
            elif col.null_count == 0:
                data[rows], mask[rows] = col.to_numpy(), False
            else:
                data[rows] = col.fill_null(0).to_numpy()
                mask[rows] = col.is_null().to_numpy()
        else:
            out[name][rows] = col.to_numpy()
