"""Long-context QA: RULER-style tasks generated offline from the essays and random facts, scored by exact match; and
a loader for LongBench-style datasets through ``datasets`` (needs a hub; not run in CI).

Offline tasks (each item: ``{"task", "prompt", "gold", "kind"}``, the prompt a completion ending where the answer
starts, about ``context_tokens`` tokens long):

- ``variable_tracking``: ``VAR A = 12345.`` then a chain ``VAR B = VAR A.`` ... scattered through the essays; asked
  the value of the chain's last variable (RULER's VT, asked as a value);
- ``fact``: one random fact ``<Name> lives in <City>.`` stated once at a random depth; asked where ``<Name>`` lives;
- ``common_words``: a long numbered list of words in which one word is the most frequent; asked that word
  (RULER's aggregation, CWE).
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections import defaultdict
from typing import Any

import torch

from .environment import environment
from .needle import NAMES, _insert_needles, generate_cells
from .plots import metric_vs_budget
from .sweep import budget_label, decoded_cells, policy_grid, progress, stable_seed

TASKS = ("variable_tracking", "fact", "common_words")
CITIES = (
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tbilisi",
    "Bergen",
    "Hanoi",
    "Lima",
    "Perth",
    "Dakar",
    "Tallinn",
    "Cusco",
)
WORDS = (
    "apple",
    "river",
    "candle",
    "marble",
    "tiger",
    "violin",
    "pepper",
    "harbor",
    "meadow",
    "copper",
    "lantern",
    "falcon",
    "garden",
    "saddle",
    "rocket",
    "pillow",
    "walnut",
    "sparrow",
    "quartz",
    "blanket",
    "cactus",
    "dragon",
    "engine",
    "forest",
    "glacier",
    "hammer",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "magnet",
    "needle",
    "orange",
    "parrot",
    "quiver",
    "ribbon",
    "shovel",
    "tunnel",
    "umbrella",
    "velvet",
    "wizard",
    "yogurt",
    "zipper",
    "anchor",
    "bucket",
    "canyon",
    "dolphin",
    "feather",
    "goblet",
    "helmet",
)


def _var(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def variable_tracking(
    tokenizer, context_tokens: int, seed: int, hops: int = 4, essays: str | None = None, offset: int = 0
) -> dict[str, Any]:
    rng = random.Random(seed)
    names = []
    while len(names) < hops + 1:
        v = _var(rng)
        if v not in names:
            names.append(v)
    value = str(rng.randint(10_000, 99_999))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() * 0.9 for _ in lines)
    header = "Memorize the variable assignments hidden in the following text and follow them.\n\n"
    question = f"\n\nQuestion: what is the value of VAR {names[-1]}? Answer: the value of VAR {names[-1]} is"
    text, _, n = _insert_needles(tokenizer, context_tokens, header, list(zip(depths, lines)), question, offset, essays)
    return {"task": "variable_tracking", "prompt": text, "gold": value, "kind": "number", "n_tokens": n}


def fact(tokenizer, context_tokens: int, seed: int, essays: str | None = None, offset: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    name, city = rng.choice(NAMES), rng.choice(CITIES)
    sentence = f"{name} lives in {city}."
    header = "Read the following text; a question about one fact stated in it follows.\n\n"
    question = f"\n\nQuestion: where does {name} live? Answer: {name} lives in"
    text, _, n = _insert_needles(
        tokenizer, context_tokens, header, [(rng.random(), sentence)], question, offset, essays
    )
    return {"task": "fact", "prompt": text, "gold": city, "kind": "word", "n_tokens": n}


def common_words(tokenizer, context_tokens: int, seed: int, top_count: int = 0) -> dict[str, Any]:
    """A numbered list of words filling ``context_tokens``: one word appears ``top_count`` times (default: about
    a tenth of the list), the others at most a third as often."""
    rng = random.Random(seed)
    header = "Below is a numbered list of words. In the list, some words appear more often than others.\n"
    question = "\nQuestion: what is the most frequent word in the list above? Answer: the most frequent word is"
    sample = "\n".join(f"{i}. {w}" for i, w in zip(range(100, 120), WORDS))
    per = len(tokenizer.encode(sample, add_special_tokens=False)) / 20
    overhead = len(tokenizer.encode(header + question, add_special_tokens=False))
    n_items = max(int((context_tokens - overhead) / per), 6)
    top = rng.choice(WORDS)
    top_count = top_count or max(3, n_items // 10)
    others = [w for w in WORDS if w != top]
    cap = max(1, top_count // 3)
    items, counts = [top] * min(top_count, n_items), defaultdict(int)
    while len(items) < n_items:
        w = rng.choice(others)
        if counts[w] < cap:
            counts[w] += 1
            items.append(w)
        elif all(counts[o] >= cap for o in others):
            break
    rng.shuffle(items)
    body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    text = header + body + question
    return {
        "task": "common_words",
        "prompt": text,
        "gold": top,
        "kind": "word",
        "n_tokens": len(tokenizer.encode(text)),
    }


def make_item(
    task: str, tokenizer, context_tokens: int, seed: int, essays: str | None = None, offset: int = 0
) -> dict[str, Any]:
    """One item of ``task`` (see :data:`TASKS`)."""
    if task == "variable_tracking":
        return variable_tracking(tokenizer, context_tokens, seed, essays=essays, offset=offset)
    if task == "fact":
        return fact(tokenizer, context_tokens, seed, essays=essays, offset=offset)
    if task == "common_words":
        return common_words(tokenizer, context_tokens, seed)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def normalize(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed (SQuAD's normalisation)."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def first_answer(generated: str, kind: str) -> str:
    """The answer a completion gives: its first number (``kind="number"``) or its first word."""
    pattern = r"\d+" if kind == "number" else r"[A-Za-z][A-Za-z'-]*"
    found = re.search(pattern, generated)
    return found.group(0) if found else ""


@functools.lru_cache(maxsize=1)
def _evaluate_exact_match():
    """``evaluate``'s exact_match metric when it loads (it is a hub script: offline it does not), else None."""
    try:
        import evaluate

        return evaluate.load("exact_match")
    except Exception:  # noqa: BLE001 - any failure to load means: use the local metric
        return None


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Share of predictions equal to their reference after :func:`normalize` (``evaluate``'s metric if it loads)."""
    metric = _evaluate_exact_match()
    preds, refs = [normalize(p) for p in predictions], [normalize(r) for r in references]
    if metric is not None:
        return float(metric.compute(predictions=preds, references=refs)["exact_match"])
    return sum(p == r for p, r in zip(preds, refs)) / max(len(refs), 1)


# ------------------------------------------------------------------------------------------------ LongBench loader

LONGBENCH_PROMPTS = {
    "narrativeqa": "You are given a story and a question. Answer as concisely as you can.\n\nStory: {context}\n\n"
    "Question: {input}\n\nAnswer:",
    "qasper": "Answer the question based on the article below as concisely as you can.\n\nArticle: {context}\n\n"
    "Question: {input}\n\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give the answer.\n\n{context}\n\n"
    "Question: {input}\nAnswer:",
    "passage_retrieval_en": "Here are paragraphs and an abstract. Which paragraph is the abstract from? Answer like "
    '"Paragraph 1".\n\n{context}\n\nAbstract: {input}\n\nThe answer is:',
}


def load_longbench(
    task: str,
    dataset: str = "THUDM/LongBench",
    split: str = "test",
    limit: int | None = None,
    template: str | None = None,
) -> list[dict[str, Any]]:
    """LongBench-style items through ``datasets`` (needs the hub): ``{"task", "prompt", "gold", "golds", "kind"}``.

    ``dataset`` may be any ``datasets`` id with ``context``/``input``/``answers`` columns; ``template`` formats the
    prompt (default: LongBench's for the known tasks, else a generic one). Scored by exact match on the first gold
    answer's normalisation, or ``contains`` (any gold inside the generation) with :func:`score_longbench`.
    """
    from datasets import load_dataset

    ds = load_dataset(dataset, task, split=split, trust_remote_code=True)
    template = template or LONGBENCH_PROMPTS.get(task, "{context}\n\nQuestion: {input}\nAnswer:")
    out = []
    for i, row in enumerate(ds):
        if limit is not None and i >= limit:
            break
        answers = list(row["answers"])
        out.append(
            {
                "task": task,
                "prompt": template.format(context=row["context"], input=row["input"]),
                "gold": answers[0],
                "golds": answers,
                "kind": "text",
            }
        )
    return out


def score_longbench(generated: str, item: dict[str, Any]) -> bool:
    """A gold answer appears (normalised) in the first line of the generation."""
    line = normalize(generated.strip().split("\n")[0])
    return any(normalize(g) and normalize(g) in line for g in item.get("golds", [item["gold"]]))


def score_item(generated: str, item: dict[str, Any]) -> bool:
    if item["kind"] == "text":
        return score_longbench(generated, item)
    return exact_match([first_answer(generated, item["kind"])], [item["gold"]]) == 1.0


# --------------------------------------------------------------------------------------------------------- recipe


def run_qa(cfg, model, tok, text, results, shard) -> None:
    """Per task × length × item: one prefill, then the greedy answer under dense and every (policy, budget)."""
    p = {"tasks": list(TASKS), "items": 4, "new_tokens": 8, "max_offset": 20000, "longbench": None, **cfg.get("qa", {})}
    cells = decoded_cells(policy_grid(cfg["policies"], cfg["budgets"]))
    if not any(c.budget is None for c in cells):
        cells = [policy_grid([{"name": "dense"}], [])[0], *cells]
    done = results.done(("task", "length", "item", "policy", "budget"))
    units = [(t, int(n), i) for t in p["tasks"] for n in cfg["lengths"] for i in range(p["items"])]
    longbench = {}
    for idx, (task, length, i) in enumerate(progress(units, len(units), "qa", shard)):
        todo = [c for c in cells if (task, length, i, *c.key) not in done]
        if not shard.mine(idx) or not todo:
            continue
        seed = stable_seed(cfg["seed"], task, length, i)
        if task in TASKS:
            offset = random.Random(seed).randrange(0, max(1, p["max_offset"]))
            item = make_item(task, tok, length, seed, essays=text, offset=offset)
        else:  # a LongBench task name: items from the hub, cut to the length from the left of the context
            if task not in longbench:
                longbench[task] = load_longbench(task, **(p["longbench"] or {}))
            item = longbench[task][i]
        ids = tok.encode(item["prompt"])
        if len(ids) > length:  # keep the question: cut the middle of an over-long prompt
            ids = ids[: length // 2] + ids[-(length - length // 2) :]
        ids = torch.tensor([ids], device=model.device)
        gens, sec = generate_cells(model, ids, todo, cfg, p["new_tokens"])
        for c in todo:
            g = tok.decode(gens[c.key])
            results.append(
                {
                    "task": task,
                    "length": length,
                    "item": i,
                    "policy": c.label,
                    "budget": budget_label(c.budget),
                    "budget_value": None
                    if c.budget is None
                    else (c.budget if isinstance(c.budget, float) else c.budget / length),
                    "gold": item["gold"],
                    "generated": g,
                    "correct": bool(score_item(g, item)),
                    "seconds": sec,
                }
            )


def summarize_qa(cfg, results, title: str) -> list[dict[str, Any]]:
    rows = [r for r in results.rows() if "task" in r]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["length"], r["policy"], r["budget"])].append(r)
    out = []
    for (task, length, policy, budget), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][:3], -(kv[1][0]["budget_value"] or 2))
    ):
        out.append(
            {
                "task": task,
                "length": length,
                "policy": policy,
                "budget": budget,
                "budget_value": rs[0]["budget_value"],
                "items": len(rs),
                "accuracy": round(sum(r["correct"] for r in rs) / len(rs), 4),
            }
        )
    results.write_summary(out, {"recipe": "qa", "model": cfg["model"], **environment()})
    for task in sorted({r["task"] for r in out}):
        mine = [{**r, "length": r["length"]} for r in out if r["task"] == task]
        metric_vs_budget(mine, "accuracy", results.path / f"qa_{task}_vs_budget.png", "exact match", f"{title}\n{task}")
    return out
