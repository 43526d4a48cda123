"""Selection policies, one ``@dataclass`` each; :data:`POLICIES` is the one registry of their string names."""

from .base import Counts, DecodeState, Policy, Selection, StateSpec
from .blocks import BlockTopK, OracleBlockTopK, Quest
from .compress import SnapKV
from .fp8 import Fp8BlockTopK
from .projected import ProjectedBlockTopK, ProjectedTokenTopK
from .quant import QuantBlockTopK
from .simple import Dense, SinkWindow
from .tokens import TokenTopK
from .top_p import TopPBlockTopK
from .two_stage import TwoStageBlockTopK, TwoStageTokenTopK

POLICIES: dict[str, type[Policy]] = {
    "dense": Dense,
    "sink_window": SinkWindow,
    "quest": Quest,
    "block_topk": BlockTopK,
    "oracle_block_topk": OracleBlockTopK,
    "token_topk": TokenTopK,
    "snapkv": SnapKV,
    "projected_block_topk": ProjectedBlockTopK,
    "projected_token_topk": ProjectedTokenTopK,
    "two_stage_block_topk": TwoStageBlockTopK,
    "two_stage_token_topk": TwoStageTokenTopK,
    "top_p_block_topk": TopPBlockTopK,
    "quant_block_topk": QuantBlockTopK,
    "fp8_block_topk": Fp8BlockTopK,
}

__all__ = [
    "POLICIES",
    "BlockTopK",
    "Counts",
    "DecodeState",
    "Dense",
    "Fp8BlockTopK",
    "OracleBlockTopK",
    "Policy",
    "ProjectedBlockTopK",
    "ProjectedTokenTopK",
    "QuantBlockTopK",
    "Quest",
    "Selection",
    "SinkWindow",
    "SnapKV",
    "StateSpec",
    "TokenTopK",
    "TopPBlockTopK",
    "TwoStageBlockTopK",
    "TwoStageTokenTopK",
]
