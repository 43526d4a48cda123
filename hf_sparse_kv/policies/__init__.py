"""Selection policies, one ``@dataclass`` each; :data:`POLICIES` is the one registry of their string names."""

from .base import DecodeState, Policy, Selection, StateSpec
from .blocks import BlockTopK, OracleBlockTopK, Quest
from .compress import SnapKV
from .simple import Dense, SinkWindow
from .tokens import TokenTopK

POLICIES: dict[str, type[Policy]] = {
    "dense": Dense,
    "sink_window": SinkWindow,
    "quest": Quest,
    "block_topk": BlockTopK,
    "oracle_block_topk": OracleBlockTopK,
    "token_topk": TokenTopK,
    "snapkv": SnapKV,
}

__all__ = [
    "POLICIES",
    "BlockTopK",
    "DecodeState",
    "Dense",
    "OracleBlockTopK",
    "Policy",
    "Quest",
    "Selection",
    "SinkWindow",
    "SnapKV",
    "StateSpec",
    "TokenTopK",
]
