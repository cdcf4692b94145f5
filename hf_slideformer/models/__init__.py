"""Model families: how each supported HF family splits into embed -> [decoder layers] -> head.

`registry.FAMILIES` is the one list of supported families; `adapters.DecoderAdapter` names a
family's parts.
"""
from .adapters import DecoderAdapter, get_adapter
from .registry import FAMILIES, SUPPORTED_MODEL_TYPES, Family, LayerDims, get_family

__all__ = ["SUPPORTED_MODEL_TYPES", "FAMILIES", "Family", "LayerDims", "DecoderAdapter", "get_adapter", "get_family"]
