"""The two sides of a diff: each an analysis document (contract 4), from a run directory or
trace file (analysed here), an ``analysis.json`` that ``pptrace analyze --json`` wrote (so a
baseline can be kept without its traces), an :class:`~pptrace.analysis.Analysis`, or a dict.

A document is refused in one line when it is no analysis (another pptrace document, a JSON of
something else), comes from a newer schema than this pptrace reads, or lacks the sections a
diff reads."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import TraceError

ANALYSIS_SCHEMA = "pptrace.analysis/1"
_SCHEMA = re.compile(r"^pptrace\.(?P<kind>[a-z_]+)/(?P<version>\d+)$")
#: an analysis.json is a few MB at 64 ranks; a file far larger is no analysis document
MAX_DOCUMENT_BYTES = 1 << 30
_SECTIONS = {"run": dict, "ranks": list, "pipeline": dict}


@dataclass(frozen=True)
class Side:
    """One side of a diff: its analysis document and what to call it."""

    document: dict
    label: str

    def __post_init__(self):
        if not isinstance(self.document, dict):
            raise ValueError(f"a diff side is an analysis document (a dict), got {type(self.document).__name__}")


def check_document(doc, where: str) -> dict:
    """``doc`` if it is an analysis document this pptrace reads; else one clear line."""
    if not isinstance(doc, dict):
        raise TraceError(f"{where}: a JSON {type(doc).__name__}, not a pptrace analysis; give a run directory "
                         "or the analysis.json that `pptrace analyze RUN --json` writes")
    schema = doc.get("schema")
    found = _SCHEMA.match(schema) if isinstance(schema, str) else None
    if found is None:
        raise TraceError(f"{where}: not a pptrace analysis (no 'schema': '{ANALYSIS_SCHEMA}'); give a run "
                         "directory or the analysis.json that `pptrace analyze RUN --json` writes")
    if found["kind"] != "analysis":
        raise TraceError(f"{where}: a {schema} document, not an analysis; give a run directory or the "
                         "analysis.json that `pptrace analyze RUN --json` writes")
    ours = int(_SCHEMA.match(ANALYSIS_SCHEMA)["version"])
    if int(found["version"]) != ours:
        newer = int(found["version"]) > ours
        raise TraceError(f"{where}: schema {schema} is {'newer than' if newer else 'not'} the {ANALYSIS_SCHEMA} "
                         f"this pptrace reads; {'upgrade pptrace, or ' if newer else ''}analyze the run again "
                         "with this pptrace (pptrace analyze RUN --json)")
    for key, kind in _SECTIONS.items():
        if not isinstance(doc.get(key), kind):
            raise TraceError(f"{where}: an analysis without its '{key}' section; write it again with "
                             "pptrace analyze RUN --json")
    return doc


def _read_json(path: Path):
    import orjson

    try:
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise TraceError(f"{path}: {size / 1e9:.1f} GB is no analysis document; give a run directory "
                             "or the analysis.json that `pptrace analyze RUN --json` writes")
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc}); give a run directory or the analysis.json that "
                         "`pptrace analyze RUN --json` writes") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None


def load_side(source, label: str | None = None, **load_options) -> Side:
    """A :class:`Side` from a path (run directory, trace file, analysis.json), an Analysis,
    a dict document or a Side. ``load_options`` go to ``pptrace.analyze`` for runs."""
    if isinstance(source, Side):
        return source
    if hasattr(source, "to_json") and callable(source.to_json):  # an Analysis
        return Side(check_document(source.to_json(), label or "analysis"), label or str(source.run.path or "analysis"))
    if isinstance(source, dict):
        return Side(check_document(source, label or "document"), label or "document")
    path = Path(source)
    name = label or str(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory; give a run directory or an analysis.json")
    if path.is_file() and not path.name.endswith(".gz"):
        doc = _read_json(path)
        if not (isinstance(doc, dict) and "traceEvents" in doc and "schema" not in doc):
            return Side(check_document(doc, str(path)), name)
        del doc  # a trace file: analysed like a run
    from ..analysis import analyze

    return Side(check_document(analyze(path, **load_options).to_json(), str(path)), name)
