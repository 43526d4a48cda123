"""hf_sparse_kv: physically sparse long-context decoding for HuggingFace Transformers models.

```python
from hf_sparse_kv import patch_model, unpatch_model
from hf_sparse_kv.policies import Quest

patch_model(model, policy=Quest(budget=1024), mode="block")
model.generate(**inputs, max_new_tokens=64)   # a PagedKVCache is built without being asked
unpatch_model(model)                          # the original attention again
```
"""

from .cache import PagedKVCache
from .patch import cache_kwarg, is_patched, patch_model, unpatch_model

__version__ = "0.1.0"

__all__ = ["PagedKVCache", "__version__", "cache_kwarg", "is_patched", "patch_model", "unpatch_model"]
