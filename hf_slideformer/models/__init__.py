"""Model adapters: how each supported HF family splits into embed -> [decoder layers] -> head."""
from .adapters import SUPPORTED_MODEL_TYPES, DecoderAdapter, get_adapter

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderAdapter", "get_adapter"]
