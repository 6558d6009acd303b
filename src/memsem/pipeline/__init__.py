"""Pipeline layer: tile iteration with a double (``depth``-slot) buffer over refs.

``memsem.Runtime.pipeline(ref, tile_bytes=..., depth=2)`` builds a :class:`Pipeline`; this layer
works on :class:`memsem.gva.RefSpec` through the runtime and never imports the refs layer.
"""
from memsem.pipeline._pipeline import Pipeline, PipelineStats, Tile
from memsem.pipeline._report import stream_report

__all__ = ["Pipeline", "PipelineStats", "Tile", "stream_report"]
