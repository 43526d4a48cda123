"""The new GPU test with the runner's pool a bare graph_pool_handle() (what DecodeGraphs made before): must fail."""

import sys
import types

import torch

sys.path[:0] = ["tests", "."]
from hf_sparse_kv import graphs

graphs.graph_pool = lambda: types.SimpleNamespace(id=torch.cuda.graph_pool_handle())
import test_graphs

try:
    test_graphs.test_a_runner_captures_again_into_its_pool_after_every_graph_was_freed()
    print("bare handle: the test passed")
except RuntimeError as e:
    print("bare handle: the test failed:", str(e).splitlines()[0][:140])
