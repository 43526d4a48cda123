"""Needle in a haystack: trials (one needle, multi-key, multi-value), their scoring, and greedy answers under several
policies from one shared prefill.

Every answer token is produced by a decode step that ran the policy: the prompt minus its last token is prefilled
(dense, as the patched model always does), then the last prompt token and the answer are fed one token at a time
through the model patched with each policy in turn (the prefilled :class:`~hf_sparse_kv.PagedKVCache` is copied per
policy, so the prefill is paid once per trial).
"""

from __future__ import annotations

import copy
import random
import re
import time
from contextlib import contextmanager
from typing import Any

import torch

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.cache import PagedLayer
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, Policy

from .slots import DecodeSlots
from .text import _boundary_near, _leading_specials, essay_tokens, needle_prompt, score_answer

VARIANTS = ("single", "multi_key", "multi_value")
NAMES = ("Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena")
MK_NEEDLE = "The pass key of {name} is {value}. Remember it. {value} is the pass key of {name}."
MK_QUESTION = "\n\nWhat is the pass key of {name}? The pass key of {name} is"
MV_NEEDLE = "One of the special magic numbers for {key} is {value}."
MV_QUESTION = "\n\nWhat are all the special magic numbers for {key}? The special magic numbers for {key} are"
# single-needle phrasings beside text.needle_prompt's pass key (phrasing 0): (header, needle, question), {value} filled
PHRASINGS = (
    None,
    (
        "A special magic number is hidden somewhere in the following text. Make sure to memorize it.\n\n",
        "One of the special magic numbers for the blue lighthouse is: {value}.",
        (
            "\n\nWhat is the special magic number for the blue lighthouse mentioned in the text? "
            "The special magic number for the blue lighthouse is"
        ),
    ),
    (
        "Read the following document carefully; you will be asked about a code mentioned in it.\n\n",
        "Note for the archive: the combination of the old iron safe is {value}.",
        "\n\nQuestion: what is the combination of the old iron safe? Answer: the combination of the old iron safe is",
    ),
)
MK_HEADER = (
    "There are pass keys hidden inside a lot of irrelevant text. Find them and memorize them. "
    "I will quiz you about one of them at the end.\n\n"
)
MV_HEADER = (
    "There are special magic numbers hidden inside a lot of irrelevant text. Find them and memorize them. "
    "I will quiz you about them at the end.\n\n"
)


def _insert_needles(
    tokenizer: Any,
    context_tokens: int,
    header: str,
    needles: list[tuple[float, str]],
    question: str,
    offset: int,
    essays: str | None,
) -> tuple[str, list[int], int]:
    """Essay haystack with each ``(depth, sentence)`` inserted at the sentence boundary nearest its depth.

    Returns (text, token position of each needle's start in ``encode(text)``, tokens of the text)."""
    overhead = sum(
        len(tokenizer.encode(s, add_special_tokens=False)) for s in [header, question, *(n for _, n in needles)]
    )
    n_hay = context_tokens - overhead - 2 * len(needles)
    if n_hay <= 0:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for a haystack (overhead {overhead})")
    hay = essay_tokens(tokenizer, n_hay, offset=offset, essays=essays)
    cuts = [_boundary_near(tokenizer, hay, round(d * n_hay)) for d, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (cuts[i], i))
    text, prev, starts = header, 0, {}
    lead = _leading_specials(tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False))
    for i in order:
        piece = tokenizer.decode(hay[prev : cuts[i]]).strip()
        text += (piece + " ") if piece else ""
        starts[i] = lead + len(tokenizer.encode(text.rstrip(), add_special_tokens=False))
        text += needles[i][1] + " "
        prev = cuts[i]
    text = text + tokenizer.decode(hay[prev:]).strip() + question
    ids = tokenizer.encode(text)
    positions = []
    for i in range(len(needles)):
        pos = starts[i]
        while pos < len(ids) and not tokenizer.decode([ids[pos]]).strip():
            pos += 1
        positions.append(pos)
    return text, positions, len(ids)


def needle_trial(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    variant: str = "single",
    seed: int = 0,
    offset: int = 0,
    n_needles: int = 4,
    essays: str | None = None,
    phrasing: int = 0,
) -> dict[str, Any]:
    """One trial: ``{"text", "answers", "needle_token_pos", "n_tokens", "variant"}``.

    - ``single``: one needle at ``depth``: :func:`evaluation.text.needle_prompt`'s pass key (``phrasing=0``) or
      another wording of :data:`PHRASINGS` (``1``: a RULER-style magic number, ``2``: a safe's combination);
    - ``multi_key``: ``n_needles`` pass keys of different people, the asked one at ``depth``, the others at random
      depths; ``answers`` holds the asked value;
    - ``multi_value``: ``n_needles`` values of one key, the first at ``depth``, the others at random depths; all of
      them must be named.

    Values are random 5-digit numbers from ``random.Random(seed)``; ``needle_token_pos`` is where the asked (first)
    needle starts in ``tokenizer.encode(text)``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    rng = random.Random(seed)
    if not 0 <= phrasing < len(PHRASINGS):
        raise ValueError(f"phrasing must lie in [0, {len(PHRASINGS)}), got {phrasing}")
    if variant == "single" and phrasing:
        header, needle, question = PHRASINGS[phrasing]
        value = str(rng.randint(10_000, 99_999))
        text, pos, n = _insert_needles(
            tokenizer, context_tokens, header, [(depth, needle.format(value=value))], question, offset, essays
        )
        return {"text": text, "answers": [value], "needle_token_pos": pos[0], "n_tokens": n, "variant": variant}
    if variant == "single":
        p = needle_prompt(tokenizer, context_tokens, depth, seed=seed, offset=offset, essays=essays)
        return {
            "text": p["text"],
            "answers": [p["answer"]],
            "needle_token_pos": p["needle_token_pos"],
            "n_tokens": p["n_tokens"],
            "variant": variant,
        }
    values = rng.sample(range(10_000, 100_000), n_needles)
    depths = [depth] + [rng.random() for _ in range(n_needles - 1)]
    if variant == "multi_key":
        names = rng.sample(NAMES, n_needles)
        needles = [(d, MK_NEEDLE.format(name=n, value=v)) for d, n, v in zip(depths, names, values)]
        header, question, answers = MK_HEADER, MK_QUESTION.format(name=names[0]), [str(values[0])]
    else:
        key = rng.choice(("the river", "the lantern", "the orchard", "the violin"))
        needles = [(d, MV_NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
        header, question, answers = MV_HEADER, MV_QUESTION.format(key=key), [str(v) for v in values]
    text, positions, n = _insert_needles(tokenizer, context_tokens, header, needles, question, offset, essays)
    return {"text": text, "answers": answers, "needle_token_pos": positions[0], "n_tokens": n, "variant": variant}


def score_trial(generated: str, trial: dict[str, Any]) -> bool:
    """Single / multi-key: the continuation starts with the asked value. Multi-value: every value is named."""
    if trial["variant"] == "multi_value":
        return set(trial["answers"]) <= set(re.findall(r"\d+", generated))
    return score_answer(generated, trial["answers"][0])


def policy_mode(policy: Policy, mode: str) -> str:
    """``mode`` unless the policy selects tokens and ``mode`` is ``block`` (then ``token``)."""
    return "token" if policy.granularity == "token" and mode == "block" else mode


def generate_cells(model, ids: torch.Tensor, todo: list, cfg: dict, new_tokens: int) -> tuple[dict, float]:
    """Greedy continuations of ``ids`` for the recipe cells ``todo`` (each with ``key`` and ``policy``) under the
    recipe's ``dense_layers``, ``block_size`` and ``mode``; returns ``({key: token ids}, seconds per cell)``."""
    t0 = time.perf_counter()
    policies = {c.key: c.policy for c in todo}
    gens = greedy_under_policies(
        model, ids, policies, new_tokens, cfg["dense_layers"], cfg["block_size"], cfg["mode"]
    )  # fmt: skip
    return gens, round((time.perf_counter() - t0) / len(todo), 2)


class PhaseClock:
    """Wall seconds spent in named phases (``prefill``, ``copy``, ``decode``), summed over calls: each phase starts
    and ends with a device synchronisation, so that GPU work queued inside it is charged to it and to no other.

    ``per_key``: what :func:`greedy_batch` (and :func:`greedy_under_policies`) notes per policy key (:meth:`note`):
    its ``decode`` seconds and, decoded statically, the ``graphs`` its runner captured and the ``capture`` seconds
    they took (summed over calls); :func:`greedy_batch` also notes ``phases``: the seconds of every phase during the
    policy's turn (its copy of the prefill or its own prefill, and its decoding); so does
    :func:`greedy_under_policies`."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seconds: dict[str, float] = {}
        self.per_key: dict[str, dict[str, float]] = {}

    def note(self, key, **values: float) -> None:
        """Add ``values`` to what is noted of ``key`` (its ``str``)."""
        noted = self.per_key.setdefault(str(key), {})
        for name, value in values.items():
            noted[name] = noted.get(name, 0) + value

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def own_prefill(policy: Policy) -> bool:
    """Whether ``policy`` needs a prefill of its own instead of a copy of the shared dense one: it compresses the
    prompt while prefilling (SnapKV). A policy keeping per-token state (compressed keys, low-bit codes) takes the
    copy: the cache computes the state from the stored keys when the policy first runs on it
    (``PagedKVCache.declare_state``), as the writes would have."""
    return policy.compresses


def shares_prefill(policy: Policy, prefix: PagedKVCache, shortest: int) -> bool:
    """Whether ``policy``, which prefills on its own (:func:`own_prefill`: SnapKV, which compresses the prompt by what
    its last ``observe`` queries attend), can start from the shared dense prefill instead: a copy of ``prefix`` cropped
    by ``observe`` positions, then those positions forwarded again under the policy's patch, whose queries are the
    observation (SnapKV's chunked prefill: the same scores, every stored key in view). It can when every prompt
    (``shortest``: the shortest's tokens, the decoded last one included) has more than ``observe`` tokens before its
    last one, and every layer of ``prefix`` is paged (a sliding-window layer cannot be cropped back)."""
    return _observes_inside(policy, shortest) and all(isinstance(layer, PagedLayer) for layer in prefix.layers)


def shares_base(policy: Policy, prefix: PagedKVCache, shortest: int) -> bool:
    """Whether ``policy`` (as in :func:`shares_prefill`) can start from a dense prefill of all but the last
    ``observe`` positions shared by the batch's policies of that ``observe``, on a model whose sliding-window layers
    keep ``prefix`` from being cropped back (Gemma-3): the same chunked prefill as :func:`shares_prefill`'s, one
    extra dense prefill a batch instead of one a policy."""
    return _observes_inside(policy, shortest) and not all(isinstance(layer, PagedLayer) for layer in prefix.layers)


def _observes_inside(policy: Policy, shortest: int) -> bool:
    """Whether ``policy`` prefills on its own (:func:`own_prefill`) to observe its last ``observe`` (an int)
    queries, and every prompt (``shortest``: the shortest's tokens, the decoded last one included) has more than
    ``observe`` tokens before its last one."""
    observe = getattr(policy, "observe", None)
    return own_prefill(policy) and isinstance(observe, int) and shortest - 1 > observe


def prefill_bases(policies, prefix: PagedKVCache, shortest: int, prefilled) -> dict[int, PagedKVCache]:
    """``observe -> cache`` for the policies that :func:`shares_base`: one dense prefill up to each distinct window
    (``prefilled(end)``: a new cache holding the prompts' tokens ``[:, :end]``, prefilled under the dense patch)."""
    bases: dict[int, PagedKVCache] = {}
    for q in policies.values():
        if shares_base(q, prefix, shortest) and q.observe not in bases:
            bases[q.observe] = prefilled(-1 - q.observe)
    return bases


def from_shared_prefill(model, prefix: PagedKVCache, ids: torch.Tensor, observe: int, clock, **inputs):
    """The cache a policy that :func:`shares_prefill` starts from: a copy of ``prefix`` (``ids [B, L]`` minus the
    last token, prefilled) cropped by ``observe`` positions, then those positions forwarded again through the model
    as patched now (its observation). ``inputs``: the window's other model inputs (a left-padded batch's mask up to
    the window's end and the window's position ids). A ``prefix`` prefilled only up to the window (the base of
    :func:`shares_base`) is copied as it is."""
    with clock.phase("copy"):
        cache = copy.deepcopy(prefix)
        if cache.get_seq_length() > ids.shape[1] - 1 - observe:
            cache.crop(ids.shape[1] - 1 - observe)
    with torch.no_grad(), clock.phase("prefill"):
        window = ids[:, -1 - observe : -1]
        model(window, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1, **inputs)
    return cache


class SharedObservations:
    """The observed caches of a batch's policies that start from the shared prefill (:meth:`shares`): one observation
    pass (:func:`from_shared_prefill`) per kind of observation instead of one per policy, each policy decoding on a
    copy of it and the last of its kind on the cache itself.

    A pass depends on the policy only through its ``observe_prefill`` (its method and ``observe``), the state its
    cache declares and the mode it is patched in (SnapKV's ``budget``, ``pool`` and ``then`` act at its first decode
    step, on the observation the copy carries): policies equal in those share a pass (:meth:`kind`).

    Args:
        policies: the batch's ``{key: policy}``; ``prefix``: its shared prefill; ``shortest``: its shortest prompt's
            tokens (the decoded last one included); ``mode``: the batch's mode (:func:`policy_mode` gives each
            policy's).
    """

    def __init__(self, policies: dict[Any, Policy], prefix: PagedKVCache, shortest: int, mode: str):
        self.prefix, self.shortest, self.mode = prefix, shortest, mode
        self.members: dict[tuple, list[Policy]] = {}
        for q in filter(self.shares, policies.values()):
            self.members.setdefault(self.kind(q), []).append(q)
        self.left = {k: len(v) for k, v in self.members.items()}
        self.held: dict[tuple, PagedKVCache] = {}
        self.ways: dict[tuple, str] = {}  # kind -> "take" or "observed": one way per kind (take frees blocks of it)

    def shares(self, policy: Policy) -> bool:
        """Whether ``policy`` starts from the shared prefill: :func:`shares_prefill` or :func:`shares_base`."""
        return shares_prefill(policy, self.prefix, self.shortest) or shares_base(policy, self.prefix, self.shortest)

    def kind(self, policy: Policy) -> tuple:
        return (type(policy).observe_prefill, policy.observe, policy.cache_state(), policy_mode(policy, self.mode))

    def take(self, policy: Policy, clock, model, base: PagedKVCache, ids: torch.Tensor, observe: int, **inputs):
        """``policy``'s cache: for the first of its kind its observation pass (:func:`from_shared_prefill` of
        ``model`` as patched now, ``base``, ``ids``, ``observe``, ``inputs``), less what every policy of the kind
        frees (:func:`release_common`), then a copy of that cache, the cache itself for the last of its kind."""
        k = self._way(policy, "take")
        cache = self.held.pop(k, None)
        if cache is None:
            cache = from_shared_prefill(model, base, ids, observe, clock, **inputs)
            if self.left[k] > 1:  # copies follow: each holds only what some policy of the kind keeps
                with clock.phase("copy"):
                    release_common(cache, self.members[k])
        self.left[k] -= 1
        if self.left[k] == 0:
            return cache
        self.held[k] = cache
        with clock.phase("copy"):
            return copy.deepcopy(cache)

    def observed(self, policy: Policy, clock, model, base: PagedKVCache, ids: torch.Tensor, observe: int, **inputs):
        """``policy``'s observed cache itself, not a copy, for a caller that only reads it (that loads it into a slot
        leaving out what the policy frees: :meth:`evaluation.slots.DecodeSlots.decode` with ``free``): the first of
        its kind makes the pass (as :meth:`take`), the last lets go of it. A kind is served one way, :meth:`take`'s
        or this (``ValueError`` otherwise: take frees blocks of the cache it hands on)."""
        k = self._way(policy, "observed")
        cache = self.held.get(k)
        if cache is None:
            cache = self.held[k] = from_shared_prefill(model, base, ids, observe, clock, **inputs)
        self.left[k] -= 1
        if self.left[k] == 0:
            del self.held[k]
        return cache

    def _way(self, policy: Policy, way: str) -> tuple:
        k = self.kind(policy)
        if self.ways.setdefault(k, way) != way:
            raise ValueError(f"the policies observing as {policy!r} are served by {self.ways[k]}(), not by {way}()")
        return k


def release_common(cache: PagedKVCache, policies: list[Policy]) -> int:
    """On an observed cache that ``policies`` will each decode a copy of: free now the blocks that every one of them
    frees at its first decode step (its ``blocks_to_free`` on the cache's pending observation, at that step's
    lengths) and compact the pool, so that each copy holds only what some policy keeps (on Qwen2.5 at 8 x 32K, a
    quarter or an eighth of 7.5 GB instead of all of it). The observation stays pending: each policy's first step
    still frees its own blocks (those freed here are holes already), so every policy holds the same blocks as
    without this. Returns the blocks freed: 0 when some policy frees nothing this way (no ``blocks_to_free``) or
    no observation is pending."""
    sets = [first_step_frees(cache, q) for q in policies]
    if any(s is None for s in sets):
        return 0
    common = [sorted(set.intersection(*(set(s[b]) for s in sets))) for b in range(len(cache.pads))]
    freed = cache.free_blocks(common)
    cache.compact_if_mostly_free()
    return freed


def names_what_it_frees(policy: Policy) -> bool:
    """Whether ``policy`` says which blocks an observation makes it free (SnapKV's ``blocks_to_free``)."""
    return callable(getattr(policy, "blocks_to_free", None))


def first_step_frees(cache: PagedKVCache, policy: Policy) -> list[list[int]] | None:
    """Per sequence, the blocks ``policy`` frees at ``cache``'s first decode step (its ``blocks_to_free`` of the
    cache's pending observation at that step's stored lengths), or ``None`` when no observation is pending or the
    policy frees nothing this way."""
    scores = cache.session.peek_observation()
    if scores is None or not names_what_it_frees(policy):
        return None
    # the first decode step's stored lengths, as its plan_step counts them (a filled cache holds a pad per row)
    lens = tuple(cache.get_seq_length() + 1 - p for p in cache.pads)
    return policy.blocks_to_free(scores, lens, cache.block_size)


def decodes_statically(policy: Policy, static: bool) -> bool:
    """Whether :func:`greedy_batch` with ``static`` decodes ``policy`` through static steps: all but a policy that
    frees blocks at every step (its block table changes during decoding), which decodes eagerly; one that frees
    them once (SnapKV) decodes its first step eagerly (it frees the prompt's blocks) and the others statically, or
    on a kept slot from the shared observation every step statically (the refill leaves those blocks out)."""
    return static and (not policy.frees_blocks or policy.frees_once)


def first_static_step(policy: Policy) -> int:
    """The first decode step (0-based) that a policy :func:`decodes_statically` runs statically: 1 for a policy that
    frees blocks (once: its first step frees them, eagerly), else 0."""
    return 1 if policy.frees_blocks else 0


def greedy_under_policies(
    model,
    ids: torch.Tensor,
    policies: dict[Any, Policy],
    new_tokens: int,
    dense_layers=(0, 1),
    block_size: int = 16,
    mode: str = "block",
    eos: int | None = None,
    clock: PhaseClock | None = None,
) -> dict[Any, list[int]]:
    """Greedy continuations of ``ids [1, L]`` under each policy through the patched model, one prefill shared.

    Returns ``{key: generated token ids}``; every generated token comes from a decode step that ran the policy.
    A policy for which :func:`own_prefill` holds (SnapKV) forwards its observation window again on a cropped copy
    of the shared prefill (:func:`shares_prefill`) or on a copy of a dense prefill up to that window
    (:func:`shares_base`: models with sliding layers), or else prefills on its own; policies observing alike share
    one such pass (:class:`SharedObservations`), each decoding on a copy of it. ``clock`` (when given) gets the
    seconds of the phases ``prefill`` (the shared one, the policies' own and their observation windows), ``copy``
    (of the shared cache) and ``decode``.
    """
    kw = {"use_cache": True}
    clock = clock or PhaseClock(ids.device)
    patch_model(model, policy=Dense(), mode="block", dense_layers=dense_layers, block_size=block_size)
    try:

        def prefilled(end: int = -1) -> PagedKVCache:
            cache = PagedKVCache(model.config, block_size=block_size)
            with torch.no_grad(), clock.phase("prefill"):
                model(ids[:, :end], **{cache_kwarg(model): cache}, **kw, logits_to_keep=1)  # the cache, not logits
            return cache

        prefix = prefilled()
        bases = prefill_bases(policies, prefix, ids.shape[1], prefilled)  # observe -> a base (sliding-layer models)
        observations = SharedObservations(policies, prefix, ids.shape[1], mode)
        out = {}
        for key, policy in policies.items():
            before = sum(clock.seconds.values())
            patch_model(
                model, policy=policy, mode=policy_mode(policy, mode), dense_layers=dense_layers, block_size=block_size
            )
            if observations.shares(policy):
                W = policy.observe
                cache = observations.take(policy, clock, model, bases.get(W, prefix), ids, W)
            elif own_prefill(policy):
                cache = prefilled()
            else:
                with clock.phase("copy"):
                    cache = copy.deepcopy(prefix)
            token, gen = ids[:, -1:], []
            decoded = clock.seconds.get("decode", 0.0)
            with torch.no_grad(), clock.phase("decode"):
                for _ in range(new_tokens):
                    logits = model(token, **{cache_kwarg(model): cache}, **kw).logits[0, -1]
                    nxt = int(logits.argmax())
                    gen.append(nxt)
                    if eos is not None and nxt == eos:
                        break
                    token = torch.tensor([[nxt]], device=ids.device)
            clock.note(
                key,
                phases=sum(clock.seconds.values()) - before,
                decode=clock.seconds["decode"] - decoded,
                graphs=0,
                capture=0.0,
            )
            out[key] = gen
    finally:
        unpatch_model(model)
    return out


def stacked_prefill(model, prompts: list[list[int]], block_size: int, clock: PhaseClock) -> PagedKVCache:
    """The cache of the left-padded batch of ``prompts`` minus their last tokens, as ``model`` (patched) prefills it,
    made from one prefill per prompt (unpadded, unmasked) stacked into one cache (``PagedKVCache.stacked``)."""
    width = max(map(len, prompts))
    rows = []
    with torch.no_grad(), clock.phase("prefill"):
        for p in prompts:
            cache = PagedKVCache(model.config, block_size=block_size)
            row = torch.tensor([p[:-1]], device=model.device)
            model(row, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
            rows.append(cache)
        return PagedKVCache.stacked(model.config, rows, [width - len(p) for p in prompts], consume=True)


def pad_left(prompts: list[list[int]], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` left-padded to the longest: (ids, attention mask, position ids), each ``[B, width]``; a padded
    position has mask 0 and position 0, a sequence's first token position 0."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def greedy_batch(
    model,
    prompts: list[list[int]],
    policies: dict[Any, Policy],
    new_tokens: int,
    dense_layers=(0, 1),
    block_size: int = 16,
    mode: str = "block",
    pad_id: int = 0,
    clock: PhaseClock | None = None,
    static: bool = False,
    slots: DecodeSlots | None = None,
    top2: dict | None = None,
    prefill: str = "batch",
) -> list[dict[Any, list[int]]]:
    """:func:`greedy_under_policies` for several prompts at once: left-padded into one batch, one shared prefill,
    then every policy decodes all of them together (the patched attention stores no padding and runs each
    sequence's policy at its own length). Returns one ``{key: generated token ids}`` per prompt (``new_tokens``
    each). One prompt takes the batch-1 path itself (but with ``static``). ``clock``: as in
    :func:`greedy_under_policies`.

    ``static``: each policy's decode steps run as static steps (:class:`~hf_sparse_kv.graphs.DecodeGraphs` on its
    copy of the prefilled cache: captured as CUDA graphs on a GPU, where an eager step of a small model is bound by
    the host; the same step uncaptured on the CPU), except for a policy that frees blocks at every step, which
    decodes eagerly (one that frees them once, SnapKV, decodes its first step eagerly: that step frees them).
    The tokens are those of the eager steps (tested on the CPU for every mode; a captured step replays the same
    kernels). ``slots`` (with ``static``): a :class:`~evaluation.slots.DecodeSlots` kept across the batches of a
    job: each static policy decodes on its refilled slot with the steps captured in earlier batches instead of
    on a copy of the prefill with steps captured anew; SnapKV too, from its first step, when it starts from the
    batch's shared observation (the slot refilled from the observed cache itself, less the blocks its first step
    frees: :func:`first_step_frees`, ``PagedKVCache.load_static(free=...)``), instead of a copy of that cache, an
    eager first step and steps captured anew every batch.

    ``top2``: a dict that receives, per policy key, the two largest float32 logits of every step and their token ids
    (``(values [B, new_tokens, 2], ids [B, new_tokens, 2])``): how close to a tie each choice was, to tell where two
    decodings of one prompt part (with ``top2``, one prompt takes the batched path too).

    ``prefill``: ``"batch"`` (the left-padded batch in one forward) or ``"rows"``: each prompt prefilled alone and the
    batch's cache stacked from theirs (``PagedKVCache.stacked``): no ``[B, 1, L, L]`` mask (8 GiB at 8 x 32K) and one
    prompt's activations at a time; the same cache up to the rounding of the model's matmuls at another batch shape
    (tested). A model with sliding-window layers (their padded window cannot be stacked) prefills the batch."""
    if prefill not in ("batch", "rows"):
        raise ValueError(f"prefill must be 'batch' or 'rows', got {prefill!r}")
    device = model.device
    clock = clock or PhaseClock(device)
    if len(prompts) == 1 and not static and top2 is None:
        ids = torch.tensor([prompts[0]], device=device)
        return [greedy_under_policies(model, ids, policies, new_tokens, dense_layers, block_size, mode, clock=clock)]
    ids, mask, pos = pad_left(prompts, device, pad_id)
    kw = {"use_cache": True}

    def every_layer_paged() -> bool:
        probe = PagedKVCache(model.config, block_size=block_size)  # no pools until written: its layers' kinds
        return len(probe.paged_layers) == len(probe.layers)

    stack = prefill == "rows" and every_layer_paged()  # sliding layers hold a padded window: prefill the batch

    def prefilled(end: int = -1) -> PagedKVCache:
        if stack and end == -1:
            return stacked_prefill(model, prompts, block_size, clock)
        cache = PagedKVCache(model.config, block_size=block_size)
        with torch.no_grad(), clock.phase("prefill"):
            model(
                ids[:, :end], attention_mask=mask[:, :end], position_ids=pos[:, :end],
                **{cache_kwarg(model): cache}, **kw, logits_to_keep=1,
            )  # fmt: skip
        return cache

    out: list[dict[Any, list[int]]] = [{} for _ in prompts]

    def slotted(q: Policy) -> bool:
        """Decoded on the kept slot: a policy that frees no blocks, or one that frees them once and says which
        (SnapKV; the refill leaves them out, when it starts from the shared observation); one that frees at every
        step gets steps of its own."""
        frees = q.frees_blocks and not (q.frees_once and names_what_it_frees(q))
        return slots is not None and decodes_statically(q, static) and not frees

    static_policies = [q for q in policies.values() if slotted(q)]
    need = ids.shape[1] - 1 + new_tokens  # tokens per sequence: the prompt, every new token, the padding
    patch_model(model, policy=Dense(), mode="block", dense_layers=dense_layers, block_size=block_size)
    try:
        prefix = prefilled()
        shortest = min(map(len, prompts))
        bases = prefill_bases(policies, prefix, shortest, prefilled)  # observe -> a base (models with sliding layers)
        observations = SharedObservations(policies, prefix, shortest, mode)
        for key, policy in policies.items():
            before = sum(clock.seconds.values())  # the policy's whole turn (copy / own prefill + decode): `phases`
            patch_model(
                model, policy=policy, mode=policy_mode(policy, mode), dense_layers=dense_layers, block_size=block_size
            )
            on_slot = slotted(policy) and (not policy.frees_blocks or observations.shares(policy))
            if observations.shares(policy):
                W = policy.observe
                window = {"attention_mask": mask[:, :-1], "position_ids": pos[:, -1 - W : -1]}
                base = bases.get(W, prefix)
                if on_slot:
                    observed = observations.observed(policy, clock, model, base, ids, W, **window)
                    free = first_step_frees(observed, policy)
                    if free is None:
                        raise RuntimeError(f"{policy!r} observed its prompt but no observation is pending")
                    with torch.no_grad(), clock.phase("copy"):
                        cache, kept = slots.decode(model, key, observed, need, static_policies, free)
                else:
                    cache = observations.take(policy, clock, model, base, ids, W, **window)
            elif own_prefill(policy):
                cache = prefilled()
            elif on_slot:
                with torch.no_grad(), clock.phase("copy"):
                    cache, kept = slots.decode(model, key, prefix, need, static_policies)
            else:
                with clock.phase("copy"):
                    cache = copy.deepcopy(prefix)
            token, m, p, gen, best = ids[:, -1:], mask, pos[:, -1:], [], []
            decoded = clock.seconds.get("decode", 0.0)
            with torch.no_grad(), clock.phase("decode"):
                runner, captured, graphs = None, 0.0, 0
                own_steps = decodes_statically(policy, static) and not on_slot
                if on_slot:
                    runner, captured, graphs = kept, kept.capture_seconds, len(kept.graphs)
                for i in range(new_tokens):
                    if own_steps and i == first_static_step(policy):  # room for the prompt and every new token
                        runner = DecodeGraphs(model, cache, need)
                    if runner is not None:
                        logits = runner.step(token, position_ids=p)
                    else:
                        logits = model(
                            token, attention_mask=m, position_ids=p, **{cache_kwarg(model): cache}, **kw
                        ).logits
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    gen.append(token)
                    if top2 is not None:
                        best.append(logits[:, -1].float().topk(2, dim=-1))
                    m = torch.cat([m, torch.ones_like(token)], 1)
                    p = p + 1
                tokens = torch.cat(gen, 1).tolist()
            clock.note(  # this batch's captures (a kept runner's earlier ones not counted)
                key,
                phases=sum(clock.seconds.values()) - before,
                decode=clock.seconds["decode"] - decoded,
                graphs=len(runner.graphs) - graphs if runner is not None else 0,
                capture=runner.capture_seconds - captured if runner is not None else 0.0,
            )
            if top2 is not None:
                top2[key] = tuple(torch.stack([getattr(b, f) for b in best], 1).cpu() for f in ("values", "indices"))
            for i in range(len(prompts)):
                out[i][key] = tokens[i]
    finally:
        unpatch_model(model)
    return out
