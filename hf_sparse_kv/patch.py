"""patch_model / unpatch_model: scoped, reversible wiring of a HF model to the sparse attention.

What patching does, all undone by :func:`unpatch_model`:

1. registers :func:`~hf_sparse_kv.attention.sparse_attention_forward` and transformers' ``sdpa_mask`` under the
   name ``"hf_sparse_kv"`` with ``AttentionInterface`` / ``AttentionMaskInterface`` (a name, not model state), and
   points the model at it with ``set_attn_implementation``;
2. adds a forward pre-hook on each attention module that passes this model's :class:`SparseConfig` and the cache to
   the attention function as keyword arguments;
3. adds a forward pre-hook on the model that refuses ``output_attentions`` and foreign caches, and builds a
   :class:`PagedKVCache` when a forward wants a cache and got none;
4. wraps the model's ``_prepare_cache_for_generation`` so ``generate()`` builds a :class:`PagedKVCache` too;
5. with ``merge_projections=True`` (the default with ``cuda_graph=True``), runs each attention's q/k/v and each MLP's
   gate/up as one matmul (:mod:`hf_sparse_kv.merge`).
"""

from __future__ import annotations

import copy
import inspect
import typing
import warnings
from collections.abc import Iterable, Mapping
from functools import partial, update_wrapper

import torch
from transformers import AttentionInterface, Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import (
    ATTENTION_NAME,
    CACHE_KWARG,
    CONFIG_KWARG,
    MODES,
    SparseConfig,
    check_cache,
    padding_starts,
    prepare_write,
    sparse_attention_forward,
)
from .cache import PagedKVCache, PagedLayer
from .crossover import CrossoverTable, calibrate_command
from .graphs import begin_static_step, captured_step, refuse_freezing
from .merge import merge, refresh, unmerge
from .ops import BACKENDS
from .ops.layout import check_block_size
from .patched import STATE_ATTR, PatchState, cache_kwarg
from .policies import Dense, Policy

__all__ = ["cache_kwarg", "is_patched", "patch_model", "unpatch_model"]

CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")  # how models and attentions take it


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]


def _num_layers(model: torch.nn.Module) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _head_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(query heads, KV heads, head dim) of ``model``'s attention from its text config (``head_dim`` where the config
    sets one, else hidden size / heads), as a crossover table keys its entries; ``None`` where the config does not say
    (the check that uses it is then skipped)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None)
    if dim is None and isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int) and heads:
        dim = config.hidden_size // heads
    shape = (heads, kv, dim)
    return shape if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape) else None


def _gpu_name(model: torch.nn.Module) -> str | None:
    """The name of the CUDA device holding ``model``'s first parameter (what a crossover table's ``device`` records),
    ``None`` off CUDA (the reference ops: no table was timed there)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    return torch.cuda.get_device_name(param.device)


def _head_model_name(model: torch.nn.Module) -> str:
    """``LlamaModel`` -> ``LlamaForCausalLM``, ``Gemma3TextModel`` -> ``Gemma3ForCausalLM``: what a user most likely
    meant to patch (for the message only)."""
    name = type(model).__name__.removesuffix("Model").removesuffix("Text")
    return f"{name}ForCausalLM"


class _Settings:
    """What patching changes, as it was before: the attention implementation of every config the model reaches
    (the inner model shares the outer one's; sub-configs of multimodal models have their own) and the methods set on
    the instance. :meth:`restore` puts them back when patching fails half-way."""

    WRAPPED = ("_prepare_cache_for_generation", "forward")

    def __init__(self, model: torch.nn.Module):
        configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "sub_configs")]
        seen: dict[int, object] = {}
        while configs:
            config = configs.pop()
            if id(config) not in seen:
                seen[id(config)] = config
                configs += [getattr(config, key) for key in config.sub_configs if getattr(config, key, None)]
        self.attn = [(c, c.__dict__.get("_attn_implementation_internal")) for c in seen.values()]
        self.methods = {name: model.__dict__[name] for name in self.WRAPPED if name in model.__dict__}

    def restore(self, model: torch.nn.Module) -> None:
        for config, value in self.attn:
            config.__dict__["_attn_implementation_internal"] = value  # not the setter: it recurses into sub-configs
        for name in self.WRAPPED:
            model.__dict__.pop(name, None)
        model.__dict__.update(self.methods)


def _validate(model, policy, mode, dense_layers, block_size, backend) -> tuple[int, ...]:
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a policy instance from hf_sparse_kv.policies (e.g. Quest(budget=1024)), got {policy!r}"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_block_size(block_size)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not hasattr(type(model), "_prepare_cache_for_generation"):
        raise TypeError(
            f"{type(model).__name__} has no generate(): patch the model with the language-model head that holds it "
            f"(e.g. {_head_model_name(model)}: patch_model(model), not model.model); the layers and the config are "
            "shared, so the inner model is patched with it."
        )
    attention = _attention_modules(model)
    if not getattr(model, "_supports_attention_backend", False) or not attention:
        raise TypeError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, so it "
            "cannot be patched; models such as Llama, Qwen2/3, Mistral and Gemma3 can."
        )
    n = _num_layers(model)
    if dense_layers is None:  # the default: the first two layers (the first, on a one-layer model)
        dense_layers = range(min(2, n))
    problem = _unsupported_attention(model, attention) or _own_cache(model)
    if problem:
        raise TypeError(problem)
    if isinstance(dense_layers, (str, bytes)) or not isinstance(dense_layers, Iterable):
        raise TypeError(f"dense_layers must be a sequence of layer indices, got {dense_layers!r}")
    layers = tuple(dense_layers)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"dense_layers must be layer indices in [0, {n}), got out-of-range or non-int {bad}")
    policy.check_patch(mode, layers)
    return layers


def _forward_parameters(cls: type) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of ``cls.forward`` (``None`` where ``inspect`` cannot read them); read once per class and call
    of :func:`_validate`'s checks (a model repeats one attention class in every layer)."""
    try:
        return inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None


def _unsupported_attention(model: torch.nn.Module, attention: list[torch.nn.Module]) -> str | None:
    """Why ``model``'s attention cannot run through the sparse attention unchanged (``None``: it can): a cache the
    attention takes under a name this patch does not look for (it would never see the paged cache and stay dense,
    silently), learned attention sinks (GPT-OSS: a per-head logit in every softmax, which the decode kernels leave
    out) or soft-capped attention logits (Gemma-2: ``cap * tanh(logit / cap)``, which neither the kernels nor SDPA
    apply)."""
    name = type(model).__name__
    signatures: dict[type, Mapping | None] = {}
    for module in attention:
        cls = type(module)
        if cls not in signatures:
            signatures[cls] = _forward_parameters(cls)
        params = signatures[cls] or {}
        if not any(p in params for p in CACHE_NAMES):
            return (
                f"{name}'s attention ({type(module).__name__}) takes its cache under none of {CACHE_NAMES}: the "
                "patched attention could not find the paged cache and would attend densely. Not supported."
            )
        rank = getattr(module, "kv_lora_rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool):
            return (
                f"{name}'s attention is multi-head latent attention ({type(module).__name__}.kv_lora_rank={rank}, as "
                "DeepSeek-V2/V3): its cache holds compressed latents, which the attention expands into keys and "
                "values after reading them, while the sparse kernels read keys and values from the pages. Not "
                "supported."
            )
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return (
                f"{name}'s attention has learned attention sinks ({type(module).__name__}.sinks, as GPT-OSS): the "
                "sparse decode kernels have no sink term in their softmax, so every step would be wrong. Not supported."
            )
        cap = getattr(module, "attn_logit_softcapping", None)
        if cap is None:
            cap = getattr(module, "softcap", None) or None  # a falsy softcap (0, False) caps nothing
        if cap is not None:
            return (
                f"{name}'s attention soft-caps its logits (attn_logit_softcapping={cap}, as Gemma-2): neither the "
                "sparse kernels nor SDPA apply the cap. Not supported (a config with attn_logit_softcapping=None "
                "patches, at the cost of what the cap changes in the model's answers)."
            )
    return None


def _own_cache(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take a :class:`PagedKVCache` (``None``: it can): a forward of the model or of a model
    inside it whose cache parameter is typed as a cache class of its own (MiniMax's ``MiniMaxCache``: its forward
    refuses any other, so every ``generate()`` would fail after patching)."""
    classes = dict.fromkeys(type(module) for module in model.modules() if hasattr(module, "config"))
    for cls in classes:  # the check reads the class's forward only: once per class
        params = _forward_parameters(cls)
        if params is None:
            continue
        for name in CACHE_NAMES:
            hint = params[name].annotation if name in params else None
            for kind in typing.get_args(hint) or (hint,):
                if isinstance(kind, type) and issubclass(kind, Cache) and not issubclass(PagedKVCache, kind):
                    return (
                        f"{type(model).__name__} keeps a cache of its own ({cls.__name__}.forward takes "
                        f"{name}: {kind.__name__}) and refuses any other, so it cannot decode from a PagedKVCache. "
                        "Not supported."
                    )
    return None


def _sparse_layers(model: torch.nn.Module, dense_layers: tuple[int, ...]) -> list[int]:
    """The layers a policy would run in: those a :class:`PagedKVCache` of ``model``'s config pages (full
    attention; sliding-window layers keep transformers' own) and ``dense_layers`` leaves to the policy."""
    return [layer.index for layer in PagedKVCache(model.config).paged_layers if layer.index not in dense_layers]


def _find_cache(kwargs: dict):
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None, None


def _as_keywords(cls: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward's positional arguments after the first as keywords, by ``cls.forward``'s parameter order (the call
    it makes is the same); left as they are where the signature cannot say (``*args``, unreadable)."""
    params = _forward_parameters(cls)
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [name for name, p in list(params.items())[1:] if p.kind in plain] if params else []
    if len(names) < len(args) or any(names[i] in kwargs for i in range(1, len(args))):
        return args, kwargs  # the forward itself reports what is wrong with this call
    return args[:1], {**dict(zip(names[1 : len(args)], args[1:])), **kwargs}


def _foreign_cache_error(cache) -> TypeError:
    return TypeError(
        f"a model patched by hf_sparse_kv needs a PagedKVCache, got {type(cache).__name__}. Pass none (generate() "
        "and forward() build one), pass hf_sparse_kv.PagedKVCache(model.config), or call unpatch_model(model) first."
    )


# the model hook plans a static step on the host: never traced (generate() compiles model.__call__); disabled where it
# is defined, so that the hook registered is this module's attribute (a patched model pickles: torch.save(model))
@torch.compiler.disable
def _model_pre_hook(model, args, kwargs):
    state: PatchState = getattr(model, STATE_ATTR)
    config: SparseConfig = state.config
    if kwargs.get("output_attentions") or getattr(model.config, "output_attentions", False):
        raise ValueError(
            "output_attentions=True is not supported on a model patched by hf_sparse_kv: sparse decode never forms "
            "the attention matrix. Call unpatch_model(model) to get attention weights."
        )
    if len(args) > 1:  # the hook reads the mask and the cache by name: a cache passed by position is found too
        args, kwargs = _as_keywords(type(model), args, kwargs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
    one = isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 1
    if not one:
        refresh(state.merged)  # a prefill: the merged projections hold the model's current weights
    _name, cache = _find_cache(kwargs)
    if cache is not None and not isinstance(cache, PagedKVCache):
        raise _foreign_cache_error(cache)
    if cache is not None:
        check_cache(cache, config)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            cache.check_batch(ids.shape[0])  # before transformers' own layers (a sliding window's cat) see the batch
        # the state this policy reads (a filled cache computes what it lacks from its stored keys): here, because a
        # static step's attention declares nothing and a captured step would run without it
        cache.declare_state(config.policy.cache_state(), config.policy.key_metadata())
        cache.session.begin_forward()  # a new forward: its decode step is planned afresh
        mask = kwargs.get("attention_mask")
        if not cache.table.rows and not cache.get_seq_length() and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            # before any layer runs: a static step's sliding rings need it, and so does the row prefill of sliding
            # layers that come before the first paged one (the first paged write declares it again, the same)
            _declare_padding(cache, mask)
        if one and cache.static_decoding and cache.static is None and cache.get_seq_length():
            cache.reserve_static(cache.max_length)  # the first decode step of a cache built for static decoding
        if cache.static is not None and not cache.session.graphs and one:  # reserved by the user: a static step
            begin_static_step(config, cache)  # outside the forward, which may be compiled
            if kwargs.get("position_ids") is None:
                kwargs["position_ids"] = cache.static.positions
    use_cache = kwargs.get("use_cache")
    if (
        cache is None
        and use_cache is None
        and (model.training or kwargs.get("labels") is not None or not _left_padded(kwargs.get("attention_mask")))
    ):  # (the mask read last: only for a forward given no cache, never a decode step's)
        # a loss, a training step or a forward over a batch that pages cannot hold (padded on the right: a scoring
        # harness's batch) that did not ask for a cache: none (the forward is the unpatched one; nothing decodes on
        # from a right-padded batch); the config's use_cache would have made one, whose pages refuse the padding
        kwargs["use_cache"] = use_cache = False
    if cache is None and (use_cache or (use_cache is None and getattr(model.config, "use_cache", False))):
        kwargs[cache_kwarg(model)] = PagedKVCache(model.config, config.block_size, config.backend)
    return args, kwargs


def _left_padding(mask: torch.Tensor) -> list[int] | None:
    """Each row's left padding of a 2-D mask ``[B, L]`` (``padding_starts``, a host read), or ``None`` where the mask
    is not left padding only (padded on the right, holes)."""
    B, L = mask.shape
    try:
        return padding_starts(mask.bool()[:, None, None, :], B, L, mask.device).tolist()
    except NotImplementedError:
        return None


def _left_padded(mask) -> bool:
    """Whether a forward's ``attention_mask`` is one the pages hold: none, not a 2-D ``[B, L]`` one (a 4-D mask is
    the attention's business), or left padding only (:func:`_left_padding`)."""
    return not isinstance(mask, torch.Tensor) or mask.dim() != 2 or _left_padding(mask) is not None


def _declare_padding(cache: PagedKVCache, mask: torch.Tensor) -> None:
    """Declare the left padding of a prefill's 2-D mask ``[B, L]`` to an empty cache (left padding only; a mask
    with holes declares nothing: the first paged layer's write then refuses it)."""
    pads = _left_padding(mask)
    if pads is not None:
        cache.set_padding(pads)


def _attention_pre_hook(config: SparseConfig, module, args, kwargs):
    if getattr(module.config, "_attn_implementation", None) != ATTENTION_NAME:
        # the attention was pointed elsewhere (e.g. a model sharing this config was unpatched): the cache must then
        # hand the attention the whole context, as for any other attention function
        return args, kwargs
    _, cache = _find_cache(kwargs)
    if cache is not None and not isinstance(cache, PagedKVCache):
        raise _foreign_cache_error(cache)
    if isinstance(cache, PagedKVCache) and module.layer_idx >= len(cache.layers):
        raise ValueError(
            f"this PagedKVCache has {len(cache.layers)} layers but the model has at least {module.layer_idx + 1}: "
            "build the cache from the model's own config, PagedKVCache(model.config)"
        )
    static = isinstance(cache, PagedKVCache) and cache.static is not None  # a static step: nothing to prepare
    if isinstance(cache, PagedKVCache) and isinstance(cache.layers[module.layer_idx], PagedLayer) and not static:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        prepare_write(cache, config, module.layer_idx, mask, hidden.shape[0], hidden.shape[1], hidden.device)
    kwargs[CONFIG_KWARG] = config
    kwargs[CACHE_KWARG] = cache
    return args, kwargs


def _prepare_cache_for_generation(
    model, original, generation_config, model_kwargs, generation_mode=None, batch_size=None, max_cache_length=None
):
    config: SparseConfig = getattr(model, STATE_ATTR).config
    if config.policy.frees_blocks and str(getattr(generation_mode, "value", generation_mode)) == "assisted_generation":
        raise ValueError(
            f"{type(config.policy).__name__} frees blocks as it decodes, one token a forward; assisted and "
            "prompt-lookup decoding verify several tokens a forward, which run dense over the whole cache (it would "
            "never free them, its memory growing with the output) or stop midway once blocks were freed. Generate "
            "without assistant_model / prompt_lookup_num_tokens, or patch with a policy that keeps every block."
        )
    _name, cache = _find_cache(model_kwargs)
    if cache is not None and not isinstance(cache, PagedKVCache):
        raise _foreign_cache_error(cache)
    if cache is not None:
        check_cache(cache, config)
    if cache is None and generation_config.use_cache is not False:
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} conflicts with hf_sparse_kv's paged "
                "cache; leave it unset on a patched model (where the model's own generation config sets it: "
                "model.generation_config.cache_implementation = None)."
            )
        # compile_config: decode in static steps, which transformers compiles (unless cuda_graph=True captures them)
        static = generation_config.compile_config is not None and not config.cuda_graph and bool(max_cache_length)
        # a policy that frees blocks reuses them: no reservation, unless it frees them once and its steps are
        # captured (reserved after its first decode step, which frees them)
        frees, once = config.policy.frees_blocks, config.policy.frees_once
        model_kwargs[cache_kwarg(model)] = PagedKVCache(
            model.config,
            config.block_size,
            config.backend,
            max_length=max_cache_length if not frees or (once and config.cuda_graph) else None,
            static=static and not frees,
        )
        if generation_config.cache_implementation == "dynamic":  # what was asked for: a cache that grows
            generation_config = copy.copy(generation_config)  # transformers refuses a name beside a cache
            generation_config.cache_implementation = None
    return original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)


def _graph_forward(model, original, *args, **kwargs):
    """``model.forward`` under ``cuda_graph=True``: a decode step that :func:`hf_sparse_kv.graphs.step_applies` to
    replays a captured graph; anything else runs ``original``."""
    _, cache = _find_cache(kwargs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    logits = captured_step(model, original, cache, ids, kwargs)
    if logits is None:
        return original(*args, **kwargs)
    return CausalLMOutputWithPast(logits=logits, **{cache_kwarg(model): cache})


def _register() -> None:
    AttentionInterface.register(ATTENTION_NAME, sparse_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def patch_model(
    model: torch.nn.Module,
    policy: Policy | None = None,
    mode: str = "block",
    dense_layers: Iterable[int] | None = None,
    block_size: int = 16,
    backend: str = "auto",
    crossover: CrossoverTable | str | None = None,
    cuda_graph: bool = False,
    compile: str | dict | None = None,
    merge_projections: bool | None = None,
    decode_linear: bool = False,
):
    """Make ``model``'s decode steps physically sparse; ``generate()`` keeps working as before.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface`` (Llama, Qwen2/3,
            Mistral, Gemma3, ...): the model with ``generate()`` (``LlamaForCausalLM``), not its inner ``model.model``
            (refused: it shares its layers and config with the outer model, which patching covers).
        policy: a policy from :mod:`hf_sparse_kv.policies` (default ``Dense()``).
        mode: ``"mask"`` (SDPA with a mask: exact, saves nothing), ``"token"`` (gather selected tokens),
            ``"block"`` (read selected pages) or ``"auto"`` (each step dense or sparse by the crossover table).
        dense_layers: layer indices that stay dense (default ``None``: the first two, or the only one of a one-layer
            model). A patch that leaves no layer to the policy (all of them here, or sliding-window layers, which
            keep transformers' own cache) warns: it decodes densely.
        block_size: tokens per page, a power of two in [8, 256].
        backend: ``"auto"`` (Triton on CUDA, PyTorch reference elsewhere), ``"reference"`` or ``"triton"``.
        crossover: with ``mode="auto"``, the table (or a JSON path) saying from which context each decode step runs
            sparse; default: a table shipped with the package for eager steps (H200) or, with ``cuda_graph=True``, for
            captured steps (H100), the one timed with this policy where there is one, else ``Quest``'s (16-token blocks;
            ``hf-sparse-kv calibrate [--policy NAME --policy-args JSON] [--timing graph]`` measures yours). A table
            that says it timed another policy (its class or cost settings,
            :func:`hf_sparse_kv.crossover.policy_key`), block size or timing warns here.
        cuda_graph: capture ``generate()``'s decode steps as CUDA graphs (static steps, see
            :mod:`hf_sparse_kv.graphs`): any mode, left-padded batches and sliding-window layers included, on a CUDA
            model with a policy that does not free blocks or frees them once (SnapKV: its first decode step, which
            frees the prompt's blocks, runs eagerly; the cache is then reserved with the freed blocks left out of
            every step); other steps run eagerly (a model on the CPU warns once, at patching, that it runs eagerly).
            A policy that frees blocks at every step (``SinkWindow(evict=True)``) is refused.
        compile: with ``cuda_graph=True``, compile each static step with ``torch.compile(fullgraph=True)`` before
            capturing it: a backend name (``"inductor"``) or a dict of ``torch.compile`` keyword arguments (inductor
            fuses the model's own small kernels: norms, rotary, SiLU; the first step of each plan key compiles).
            Inductor's ``freezing`` is refused (``ValueError`` here, ``RuntimeError`` at a static step while its
            global flag is on): it would compile the cache's pools into the step as constants.
        merge_projections: run each attention's ``q_proj``/``k_proj``/``v_proj`` and each MLP's
            ``gate_proj``/``up_proj`` as one matmul (:mod:`hf_sparse_kv.merge`): the same outputs, the same weight
            names and memory (each layer's weight becomes a view of its group's merged tensor), fewer and larger
            matmuls, which at decode read the weights closer to the memory bandwidth (0.4-0.6 ms a step on an 8B
            model on an H200). Layers that are not plain ``nn.Linear`` (quantized, parallel, hooked) stay as they are.
            Undone by :func:`unpatch_model` (each weight its own storage again). Default (``None``): on with
            ``cuda_graph=True``, where the step is bound by the weights' bytes (measured on an H200: logits bit for
            bit equal to the unmerged step's in bf16 on Qwen2.5-1.5B at 32K; 2-8 % off its step, 0.4-0.6 ms off an
            8B model's), off otherwise.
        decode_linear: with ``merge_projections``, run every decode-sized product of the merged projections and of
            each ``o_proj`` / ``down_proj`` (at most 16 tokens, bf16 / fp16, on CUDA) through the package's Triton
            matmul (:mod:`hf_sparse_kv.ops.triton.linear`) instead of cuBLAS; longer inputs (a prefill) and the CPU
            keep ``F.linear``, and so do weights where the kernel's sweep found cuBLAS as fast (``linear.choose``).
            Measured on the 8B shape (benchmarks/RESULTS.md, 2026-12-06): on an H200, timed in both orders, 0.36 /
            0.19 ms off a compiled dense step at 1 x 128K / 8 x 32K and 0.19 / 0.10 off Quest's; on H100s 0-0.3 ms
            (nothing when timed in both orders on one of them). Off by default.

    Returns:
        ``model`` itself. Patching a patched model replaces its settings; :func:`unpatch_model` restores it.

    Raises:
        TypeError, ValueError: for a bad argument or a model that cannot be patched. Every check runs before anything
            changes, and an error while patching undoes what was done: a refused call leaves the model (its config's
            attention implementation, its hooks, a previous patch) exactly as it was.
    """
    policy = Dense() if policy is None else policy
    layers = _validate(model, policy, mode, dense_layers, block_size, backend)
    previous = getattr(model, STATE_ATTR, None)
    original_attn = previous.config.original_attn if previous else model.config._attn_implementation
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph and policy.frees_blocks and not policy.frees_once:
        raise ValueError(
            f"cuda_graph=True needs a block table that does not change during decoding, and {type(policy).__name__} "
            "frees blocks at every step: patch with cuda_graph=False for it."
        )
    if compile is not None and not cuda_graph:
        raise ValueError("compile= compiles the captured static step: pass cuda_graph=True with it")
    if compile is not None and not isinstance(compile, (str, dict)):
        raise TypeError(f"compile must be a torch.compile backend name or a dict of its arguments, got {compile!r}")
    refuse_freezing(compile)
    if merge_projections is not None and not isinstance(merge_projections, bool):
        raise TypeError(
            f"merge_projections must be True, False or None (on with cuda_graph), got {merge_projections!r}"
        )
    merge_projections = bool(cuda_graph) if merge_projections is None else merge_projections
    if not isinstance(decode_linear, bool):
        raise TypeError(f"decode_linear must be True or False, got {decode_linear!r}")
    if decode_linear and not merge_projections:
        raise ValueError("decode_linear runs the merged projections' products: it needs merge_projections=True")
    table = None
    if mode == "auto":
        timing = "graph" if cuda_graph else "eager"  # a captured step's crossover differs from an eager one's
        table = crossover if isinstance(crossover, CrossoverTable) else CrossoverTable.load(crossover, timing, policy)
        budgeted = policy.budget_fraction(1) is not None  # one without a budget (Dense) never runs sparse
        problems = table.mismatch(policy, block_size, timing, _gpu_name(model)) if budgeted else []
        if problems:
            warnings.warn(
                f"mode='auto' decides dense or sparse by a crossover table measured otherwise ({'; '.join(problems)}), "
                "so its crossovers may not hold: a step may run sparse where dense is faster, or the reverse. Measure "
                f"one for this patch: `{calibrate_command(policy, block_size, timing)}`, then pass "
                "crossover='mine.json'.",
                stacklevel=2,
            )
        shape = _head_shape(model) if budgeted else None
        if shape is not None and not table.holds(*shape[1:]):
            warnings.warn(
                f"mode='auto' will run every decode step of {type(model).__name__} dense: its crossover table "
                f"({table.device}, {table.timing} steps) holds no entry for {shape[1]} KV heads of {shape[2]} "
                "channels and no fallback, so no step is ever decided sparse. Measure one for these heads: "
                f"`{calibrate_command(policy, block_size, timing, shape)}`, then pass crossover='mine.json'.",
                stacklevel=2,
            )
    elif crossover is not None:
        raise ValueError("crossover is used by mode='auto' only")
    config = SparseConfig(policy, mode, layers, block_size, backend, original_attn, table, compile, cuda_graph)
    # warned before anything changes (under warnings-as-errors a warning is a refusal: nothing half-patched)
    if cuda_graph and not any(p.is_cuda for p in model.parameters()):
        warnings.warn(
            "cuda_graph=True: the model is not on a CUDA device, so its decode steps run eagerly (CUDA graphs "
            "capture CUDA models only)",
            UserWarning,
            stacklevel=2,
        )
    elif cuda_graph and backend == "reference":
        warnings.warn(
            "cuda_graph=True with backend='reference': the reference ops index by data-dependent masks (host syncs), "
            "which a CUDA graph cannot capture, so the decode steps run statically without a graph; backend='auto' "
            "or 'triton' captures them",
            UserWarning,
            stacklevel=2,
        )
    if not isinstance(policy, Dense) and not _sparse_layers(model, layers):
        warnings.warn(
            f"no layer of {type(model).__name__} runs {type(policy).__name__}: every layer with a full-attention cache "
            f"is in dense_layers={layers} or none has one (sliding-window layers keep transformers' own cache and "
            "stay dense), so decoding reads everything. Pass fewer dense_layers to make some layers sparse.",
            stacklevel=2,
        )
    _register()
    saved = _Settings(model)
    instance = previous.instance if previous else dict(saved.methods)  # the user's own, kept through re-patches
    handles = []
    old = previous.merged if previous else []
    # stale groups, or groups of the other decode_linear setting, are merged afresh
    keep = merge_projections and bool(old) and all(g.intact() and g.kernel == decode_linear for g in old)
    merged, undone = [], []
    try:  # a previous patch stays in force until this one is complete
        handles.append(model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True))
        for module in _attention_modules(model):
            handles.append(module.register_forward_pre_hook(partial(_attention_pre_hook, config), with_kwargs=True))
        model.set_attn_implementation(ATTENTION_NAME)
        # the instance's own methods where it had them (accelerate's hooks wrap forward there), else the class's;
        # a previous patch's wrappers replaced
        original = instance.get("_prepare_cache_for_generation") or type(model)._prepare_cache_for_generation.__get__(
            model
        )
        original_forward = instance.get("forward") or type(model).forward.__get__(model)
        model.__dict__.pop("forward", None)
        if "forward" in instance:
            model.forward = instance["forward"]
        model._prepare_cache_for_generation = partial(_prepare_cache_for_generation, model, original)
        if cuda_graph:  # keeps the signature: generate() inspects forward's parameters
            model.forward = update_wrapper(partial(_graph_forward, model, original_forward), original_forward)
        if merge_projections and not keep:
            unmerge(old)  # none, or stale: each layer its own (current) weights, then merged anew
            undone, old = old, []
            merged = merge(model, decode_linear)
    except BaseException:
        for h in handles:
            h.remove()
        unmerge(merged)
        saved.restore(model)
        if undone:  # the previous patch's (stale) groups were unmerged above: merged again for it, as a new state
            try:  # (the weights moved: static steps set up before must refuse, as after any re-patch)
                regrouped = merge(model, any(g.kernel for g in undone))
            except RuntimeError:  # (out of memory, most likely) it then runs unmerged: the same outputs, slower
                regrouped = []
            setattr(model, STATE_ATTR, PatchState(previous.config, previous.handles, regrouped, previous.instance))
        raise
    for handle in previous.handles if previous else ():
        handle.remove()  # replaced by this patch's hooks
    if old and not keep:
        unmerge(old)
    setattr(model, STATE_ATTR, PatchState(config, handles, old if keep else merged, instance))
    return model


def unpatch_model(model: torch.nn.Module):
    """Undo :func:`patch_model`: the original attention again, same outputs bit for bit.

    A no-op on an object that is not patched (never patched, already unpatched, or a patched model's inner
    ``model.model``, which is unpatched with the model that holds it): it is returned unchanged."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return model
    for handle in state.handles:
        handle.remove()
    unmerge(state.merged)
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.__dict__.pop("forward", None)
    model.__dict__.update(state.instance)  # the instance's own methods from before the first patch
    model.set_attn_implementation(state.config.original_attn)
    delattr(model, STATE_ATTR)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched by :func:`patch_model`."""
    return getattr(model, STATE_ATTR, None) is not None
