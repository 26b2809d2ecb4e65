"""Outputs: the report (JSON document, terminal tables), the merged Perfetto trace, the HTA cross-check."""
